"""d9d.cli: the `d9d` command (`python -m d9d.cli` is its module form, e.g. under torchrun).

Importing this package imports neither click nor torch: `cli` (the click group) and `CliError` are
imported on first access, and each command imports what it needs when it runs, so `d9d --help`
answers at once.
"""

from d9d.cli.main import main

__all__ = ["CliError", "cli", "main"]


def __getattr__(name: str) -> object:
    if name == "cli":
        from d9d.cli._group import cli

        return cli
    if name == "CliError":
        from d9d.cli.errors import CliError

        return CliError
    raise AttributeError(f"module 'd9d.cli' has no attribute {name!r}")
