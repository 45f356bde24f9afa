"""The `d9d` click command group; each command lives in `d9d.cli.commands.<name>`.

Importing this module imports click only: torch, the trainer and the lower d9d packages are imported
inside the command functions, so `d9d --help` answers at once.
"""

import click

from d9d.cli.commands.checkpoints import checkpoints
from d9d.cli.commands.export import export
from d9d.cli.commands.init import init
from d9d.cli.commands.metrics import metrics
from d9d.cli.commands.plan import plan
from d9d.cli.commands.train import train

__all__ = ["cli", "main"]

_PACKAGES = ("d9d-mesh", "d9d-parallel", "d9d-data", "d9d-ckpt", "d9d-trainer", "d9d-cli")


def _versions() -> str:
    import importlib.metadata  # only here: keeps `d9d --help` fast

    lines = []
    for name in _PACKAGES:
        try:
            lines.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"{name} (not installed)")
    return "\n".join(lines)


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(_versions())
        ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Print the version of every installed d9d package and exit.",
)
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """d9d: composable distributed training for PyTorch.

    \b
    Examples:
      d9d init my-job && cd my-job         # a ready-to-run quickstart
      d9d plan config.yaml --world-size 8 --set mesh.data_parallel_shard=8
      d9d train config.yaml --set trainer.schedule.total_steps=400
      torchrun --nproc-per-node 4 -m d9d.cli train config.yaml --set mesh.data_parallel_shard=4
      d9d checkpoints runs/quickstart
      d9d metrics runs/quickstart
      d9d export runs/quickstart --out exported/
    """
    ctx.obj = {"debug": debug}


for _command in (init, plan, train, checkpoints, metrics, export):
    cli.add_command(_command)


def main() -> None:
    """Entry point of the `d9d` console script."""
    cli(prog_name="d9d")
