"""`d9d plan`: validate a job for a launch size without GPUs and print what it would run.

The plan is the trainer's own (`d9d.trainer.planning.plan_job` on a planning context of the launch's size, for
CUDA): this command only formats it, so it accepts and refuses what the trainer does, with its words.
It prints the mesh layout, the batching, under context parallelism each rank's share of a sequence,
under pipeline parallelism each pp rank's stages and the schedule's theoretical bubble, the precision
and a per-rank memory estimate (`plan_job(..., memory=True)`), whether that fits a device's memory
and, when it does not, which `--set` changes would make it fit (`d9d.trainer.planning.plan_fit`), and the
launch command on nodes of `--gpus-per-node` GPUs. A job that does not fit exits with
`EXIT_DOES_NOT_FIT` (3) after printing its plan, so a script can gate a launch on it.
"""

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import click

from d9d.cli.commands._launch import DEFAULT_GPUS_PER_NODE, check_launch_size, launch_shape, with_launch
from d9d.cli.commands._options import check_config_path, overrides_option
from d9d.cli.commands._plan_text import format_fit, plan_lines
from d9d.cli.commands._text import parse_size
from d9d.cli.commands.init import d9d_invocation
from d9d.cli.errors import CliError, reports_errors

if TYPE_CHECKING:  # the trainer imports torch: only inside the command at run time
    from d9d.trainer import LoadedJob
    from d9d.trainer.planning import JobPlan

__all__ = ["EXIT_DOES_NOT_FIT", "plan"]

#: Exit status of a plan that does not fit the device (printed in full first); 2 stays the status of
#: a config or launch the trainer refuses, 1 of a crash.
EXIT_DOES_NOT_FIT = 3


@click.command(short_help="Validate a config for a launch size, without GPUs.")
@click.argument("config", type=click.Path())
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    help="Processes in total, on nodes of --gpus-per-node (e.g. 64: 8 nodes of 8).",
)
@click.option("--nnodes", type=click.IntRange(min=1), help="Nodes (with --nproc-per-node).")
@click.option("--nproc-per-node", type=click.IntRange(min=1), help="Processes per node.")
@click.option(
    "--gpus-per-node",
    type=click.IntRange(min=1),
    help=f"GPUs (processes) per node for the launch of --world-size or of the mesh's size: one node "
    f"up to that many, else world / G nodes, and a world that is not a multiple of G is refused "
    f"(default {DEFAULT_GPUS_PER_NODE}).",
)
@click.option(
    "--seq-len",
    type=click.IntRange(min=1),
    help="Tokens per sample, for the activation estimate and the context-parallel split (default: the "
    "dataset's seq_len: dataset.seq_len, or its provider's default).",
)
@click.option(
    "--device-memory",
    metavar="SIZE",
    help="Memory of one device (e.g. 80GiB, 24GB, 512MiB, or bytes): says whether the job fits and, "
    "when it does not, which --set changes would make it fit (default: the local GPU's, when there is one).",
)
@click.option(
    "--launcher",
    type=click.Choice(["torchrun", "slurm"]),
    default="torchrun",
    show_default=True,
    help="torchrun: end with the command for every node; slurm: print an sbatch script instead, "
    "the plan in its comments (d9d plan ... --launcher slurm > job.sbatch && sbatch job.sbatch: a job that does not fit exits 3).",
)
@overrides_option
@reports_errors
def plan(
    config: str,
    world_size: int | None,
    nnodes: int | None,
    nproc_per_node: int | None,
    gpus_per_node: int | None,
    seq_len: int | None,
    device_memory: str | None,
    launcher: str,
    overrides: Sequence[str],
) -> None:
    """Check CONFIG for a launch size without GPUs and print its plan.

    Loads and validates the config, builds the mesh in one process (a fake process group of any
    size), and prints: which global ranks share each mesh axis, the microbatches each data-parallel
    rank runs per step, under context parallelism the cp groups and each rank's share of a
    sequence, under pipeline parallelism each pp rank's stages (their layers, the embedding, the
    head) and the schedule's theoretical bubble, the precision and activation checkpointing, a
    per-rank estimate of parameter + gradient + optimizer memory and of one microbatch's activations
    (from the model built on the meta device), whether that fits in --device-memory (or the local
    GPU) with 10% to spare and, when it does not, the --set changes that would make it fit, each
    re-planned, and the launch command on nodes of --gpus-per-node GPUs (8 by default).
    Under pipeline parallelism the memory is that of the pp rank that needs the most (named), with
    every pp rank's total. Without a size, plans for the size the mesh needs.

    Exit status: 0 when the job fits (or no device memory is known: the fit line says to pass
    --device-memory), 3 when it does not fit (the plan and its levers are printed first), 2 for a
    config or launch the trainer refuses.

    \b
    Examples:
      d9d plan config.yaml
      d9d plan config.yaml --world-size 8 --set mesh.data_parallel_shard=8
      d9d plan config.yaml --nnodes 2 --nproc-per-node 8 --set mesh.data_parallel_shard=8 \\
          --set mesh.tensor_parallel=2
      d9d plan config.yaml --world-size 8 --set mesh.data_parallel_shard=2 \\
          --set mesh.context_parallel=2 --set mesh.tensor_parallel=2
      d9d plan config.yaml --world-size 2 --set mesh.pipeline_parallel=2 \\
          --set pipelining.schedule=zbv
      d9d plan config.yaml --device-memory 80GiB
      d9d plan config.yaml --world-size 64 --gpus-per-node 4 --set mesh.data_parallel_shard=64
      d9d plan config.yaml --nnodes 4 --nproc-per-node 8 --set mesh.data_parallel_shard=auto \\
          --launcher slurm > job.sbatch && sbatch job.sbatch
    """
    shape = launch_shape(world_size, nnodes, nproc_per_node, gpus_per_node)
    device_bytes = _device_memory_option(device_memory)
    check_config_path(config)
    from d9d.trainer import load_job_config

    # a mesh degree of `auto` takes what the launch shape leaves it
    launched = shape[0] * shape[1] if shape is not None else None
    loaded = load_job_config(config, list(overrides), world_size=launched)
    nodes, per_node = check_launch_size(
        shape, loaded.config.mesh, by_world_size=world_size is not None, gpus_per_node=gpus_per_node
    )
    from d9d.trainer.planning import plan_config

    job_plan = plan_config(loaded, seq_len=seq_len, device="cuda")  # rank 0 of the launch, for CUDA
    fits, fit_lines = _fit_lines(job_plan, loaded, device_bytes)
    lines = [f"config: {config}", *plan_lines(job_plan, loaded.config), *fit_lines]
    lines = with_launch(
        lines,
        config,
        overrides,
        launcher=launcher,
        nnodes=nodes,
        nproc_per_node=per_node,
        name=loaded.config.trainer.run.name,
        d9d=d9d_invocation(),
    )
    click.echo("\n".join(lines))
    if not fits:
        sys.stdout.flush()
        sys.exit(EXIT_DOES_NOT_FIT)


def _device_memory_option(text: str | None) -> int | None:
    """--device-memory in bytes (None when not given), checked before anything is loaded."""
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise CliError(f"--device-memory {exc}") from None


def _fit_lines(job_plan: "JobPlan", loaded: "LoadedJob", device_bytes: int | None) -> tuple[bool, list[str]]:
    """Whether the plan fits the device (--device-memory, else the local GPU; True when neither is
    known) and its lines: the verdict and, when it does not fit, the levers."""
    source = "--device-memory"
    if device_bytes is None:
        import torch

        if not torch.cuda.is_available():
            return True, [
                "fit: pass --device-memory SIZE (e.g. 80GiB) to check that the job fits a device and "
                "which --set changes would make it fit"
            ]
        index = torch.cuda.current_device()
        device_bytes = torch.cuda.get_device_properties(index).total_memory
        source = f"the local GPU, {torch.cuda.get_device_name(index)}"
    from d9d.trainer.planning import plan_fit

    fit = plan_fit(job_plan, loaded, device_bytes)
    return fit.fits, format_fit(fit, source)
