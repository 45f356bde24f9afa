"""`d9d train`: run a job (one process, or one rank of a torchrun launch)."""

from collections.abc import Sequence

import click

from d9d.cli.commands._options import check_config_path, overrides_option
from d9d.cli.errors import reports_errors

__all__ = ["train"]


@click.command(short_help="Run a job (one process or under torchrun).")
@click.argument("config", type=click.Path())
@overrides_option
@reports_errors
def train(config: str, overrides: Sequence[str]) -> None:
    """Run the job in CONFIG: one process, or one rank of a torchrun launch.

    The same run name resumes from its latest checkpoint; a finished run says so and exits 0.

    \b
    Examples:
      d9d train config.yaml
      d9d train config.yaml --set trainer.run.name=try2 --set optimizer.lr=1e-3
      torchrun --nproc-per-node 2 -m d9d.cli train config.yaml --set mesh.data_parallel_shard=2
    """
    check_config_path(config)
    from d9d.trainer.entry import run_command

    run_command(config, list(overrides))  # Ctrl-C and a saved SIGTERM exit as `python train.py` does
