"""Options shared by several commands."""

import functools
from collections.abc import Callable
from typing import Any

import click

__all__ = ["check_config_path", "overrides_option"]


def _check_positional(
    _ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]
) -> tuple[str, ...]:
    for value in values:
        if "=" not in value:
            raise click.UsageError(f"unexpected argument {value!r}: an override looks like key.path=value")
    return values


def overrides_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """Config overrides as `KEY.PATH=VALUE` arguments after the first one, `--set KEY.PATH=VALUE`, or both.

    The command receives them as `overrides`: the bare ones first, then the `--set` ones (a key given
    twice takes its last value), the same syntax `python train.py CONFIG` accepts.
    """

    @functools.wraps(command)
    def with_overrides(
        *args: Any, bare_overrides: tuple[str, ...] = (), set_overrides: tuple[str, ...] = (), **kwargs: Any
    ) -> Any:
        return command(*args, overrides=(*bare_overrides, *set_overrides), **kwargs)

    with_overrides = click.option(
        "--set",
        "set_overrides",
        multiple=True,
        metavar="KEY.PATH=VALUE",
        help="Override a config value (repeatable; a bare KEY.PATH=VALUE argument works too), "
        "typed and checked by the config schema.",
    )(with_overrides)
    return click.argument(
        "bare_overrides", nargs=-1, metavar="[KEY.PATH=VALUE]...", callback=_check_positional
    )(with_overrides)


def check_config_path(config: str) -> None:
    """Fail fast (before torch is imported) when CONFIG is not a file."""
    from pathlib import Path

    from d9d.cli.errors import CliError

    path = Path(config)
    if not path.exists():
        raise CliError(f"{path}: no such config file; check the path")
    if not path.is_file():
        raise CliError(f"{path} is a directory, not a config file (a YAML file such as config.yaml)")
