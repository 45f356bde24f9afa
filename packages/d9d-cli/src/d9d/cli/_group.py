"""The `d9d` click group: it imports `d9d.cli.commands.<name>` only when that command is used.

The group's help page is `d9d.cli._table.group_help()` (the same text the entry point prints for
`d9d --help` without importing click), so listing the commands imports none of them.
"""

import difflib
import importlib

import click

from d9d.cli._table import COMMANDS, OPTIONS, group_help

__all__ = ["cli"]

_PACKAGES = ("d9d-mesh", "d9d-parallel", "d9d-data", "d9d-ckpt", "d9d-trainer", "d9d-cli")


class _LazyGroup(click.Group):
    """A group whose commands are the entries of `COMMANDS`, each imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module = importlib.import_module(f"d9d.cli.commands.{cmd_name}")
        command: click.Command = getattr(module, cmd_name)
        return command

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name = args[0]
        if name not in COMMANDS and not name.startswith("-") and not ctx.resilient_parsing:
            close = difflib.get_close_matches(name, COMMANDS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "`d9d --help` lists the commands"
            raise click.UsageError(f"No such command {name!r}; {hint}", ctx)
        return super().resolve_command(ctx, args)

    def get_help(self, ctx: click.Context) -> str:
        return group_help().rstrip("\n")


def _versions() -> str:
    import importlib.metadata  # only here: keeps the other commands' start-up short

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


@click.group(
    name="d9d",
    cls=_LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help=OPTIONS["--version"],
)
@click.option("--debug", is_flag=True, help=OPTIONS["--debug"])
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """d9d: composable distributed training for PyTorch (help page: `d9d.cli._table.group_help`)."""
    ctx.obj = {"debug": debug}
