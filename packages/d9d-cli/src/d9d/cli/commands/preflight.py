"""`d9d preflight`: check the fleet under the job's own launch before the job runs on it.

Every rank runs the checks of `d9d.trainer.planning.preflight.run_preflight` (same code and config, a shared
save_dir with room, collective bandwidth over each mesh axis, on CUDA device memory, ECC, clocks and
compute); rank 0 prints one table. Exit status 0 when every check passes, 1 when one fails, 2 for a
config or launch the job itself would refuse.
"""

import os
import sys
from collections.abc import Sequence

import click

from d9d.cli.commands._options import check_config_path, overrides_option
from d9d.cli.errors import reports_errors

__all__ = ["EXIT_FAILED_CHECK", "preflight"]

#: Exit status when a check fails (2 stays the status of a refused config or launch).
EXIT_FAILED_CHECK = 1


@click.command(short_help="Check the nodes, links and save_dir before a launch.")
@click.argument("config", type=click.Path())
@overrides_option
@click.option(
    "--size-mb",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Buffer of each timed collective, MiB (default 64 on CUDA, 4 on CPU).",
)
@click.option(
    "--iters",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Timed calls of each collective.",
)
@click.option(
    "--threshold",
    type=click.FloatRange(min=0, max=1, min_open=True, max_open=True),
    default=0.25,
    show_default=True,
    help="How far below the median (0.25: 25%) a group, rank or node fails.",
)
@reports_errors
def preflight(
    config: str, overrides: Sequence[str], size_mb: float | None, iters: int, threshold: float
) -> None:
    """Check the launch of the job in CONFIG: run it as the job runs, e.g. under the same torchrun.

    Every rank checks that it has the same d9d, torch and job code and the same config (hashes) as
    rank 0; that trainer.checkpointing.save_dir is one file system every rank sees, with room for
    num_to_keep + 1 checkpoints; and times all-reduce, all-gather and all-to-all over every mesh axis,
    naming a group, rank or node slower than the median by more than --threshold. On CUDA it also
    checks free device memory against the plan's estimate, uncorrected ECC errors and SM clocks
    (through NVML, where pynvml is installed) and each GPU's matmul speed. Rank 0 prints one table;
    the exit status is 1 when a check fails. Nothing is written.

    \b
    Examples:
      d9d preflight config.yaml
      torchrun --nproc-per-node 4 -m d9d.cli preflight config.yaml --set mesh.data_parallel_shard=4
    """
    check_config_path(config)
    from d9d.trainer import load_job_config
    from d9d.trainer.planning.preflight import format_preflight, run_preflight

    loaded = load_job_config(config, list(overrides))
    nbytes = int(size_mb * 2**20) if size_mb is not None else None
    report = run_preflight(loaded, nbytes=nbytes, iters=iters, threshold=threshold)
    if os.environ.get("RANK", "0") != "0":
        return  # rank 0 prints the table and gives the exit status (the others exit first, 0)
    click.echo("\n".join(format_preflight(report)))
    if not report.ok:
        sys.stdout.flush()
        sys.exit(EXIT_FAILED_CHECK)
