"""The `d9d` entry point; each command lives in `d9d.cli.commands.<name>`.

`d9d --help` is answered from the command table (`d9d.cli._table`) without importing click or any
command module (click alone costs several times a bare interpreter's start-up); anything else goes to
the click group in `d9d.cli._group`, which imports a command's module only when that command runs or
shows its help.
"""

import sys

from d9d.cli._table import group_help

__all__ = ["main"]

_HELP_OPTIONS = ("--help", "-h")


def main() -> None:
    """Entry point of the `d9d` console script (and of `python -m d9d.cli`)."""
    args = sys.argv[1:]
    if len(args) == 1 and args[0] in _HELP_OPTIONS:
        sys.stdout.write(group_help())
        sys.stdout.flush()
        return
    from d9d.cli._group import cli

    cli(prog_name="d9d")
