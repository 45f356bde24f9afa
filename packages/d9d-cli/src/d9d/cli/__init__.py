"""d9d.cli: the `d9d` command (`python -m d9d.cli` is its module form, e.g. under torchrun).

Importing this package is cheap: torch and the trainer are imported only by the commands that
need them, so `d9d --help` answers at once.
"""

from d9d.cli.errors import CliError
from d9d.cli.main import cli, main

__all__ = ["CliError", "cli", "main"]
