"""Options shared by several commands."""

import click

__all__ = ["check_config_path", "overrides_option"]

overrides_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY.PATH=VALUE",
    help="Override a config value (repeatable), typed and checked by the config schema.",
)


def check_config_path(config: str) -> None:
    """Fail fast (before torch is imported) when CONFIG is not a file."""
    from pathlib import Path

    from d9d.cli.errors import CliError

    path = Path(config)
    if not path.exists():
        raise CliError(f"{path}: no such config file; check the path")
    if not path.is_file():
        raise CliError(f"{path} is a directory, not a config file (a YAML file such as config.yaml)")
