"""d9d.cli: the `d9d` command (placeholder until the CLI issue lands)."""

import sys

__all__ = ["main"]


def main() -> None:
    """Entry point of the `d9d` console script."""
    print("d9d: the command line is not implemented yet; see README.md", file=sys.stderr)
    sys.exit(2)
