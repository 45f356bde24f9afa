"""How the CLI reports a user's mistake: one `error: ...` line on stderr and exit status 2.

`CliError` is raised by the commands themselves; every `d9d.mesh.D9dError` (a bad config, a mesh
mismatch, a missing checkpoint, ...) and `OSError` (a path that cannot be read or written) is
reported the same way, by rank 0 alone under a launcher. `d9d --debug COMMAND ...` shows the full
traceback instead.
"""

import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import click

__all__ = ["EXIT_ERROR", "CliError", "reports_errors"]

#: Exit status of every reported error (click's usage errors use 2 as well).
EXIT_ERROR = 2
#: Seconds a rank other than 0 waits before it exits on an error that rank 0 reports (see `reports_errors`);
#: torchrun ends the wait as soon as rank 0 has exited.
PEER_ERROR_GRACE_S = 10.0

_P = ParamSpec("_P")
_R = TypeVar("_R")


class CliError(Exception):
    """A mistake in how a command was called (a missing path, a mesh that does not fit the launch, ...)."""


def _is_user_error(exc: BaseException) -> bool:
    if isinstance(exc, CliError | OSError):
        return True
    if "d9d.mesh" not in sys.modules:  # nothing that could raise a D9dError was imported
        return False
    from d9d.mesh import D9dError

    return isinstance(exc, D9dError)


def reports_errors(func: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorate a command callback: user errors become one stderr line and exit status 2."""

    @functools.wraps(func)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            if _debug():
                raise
            if "d9d.trainer" in sys.modules and not isinstance(exc, CliError):
                # A job's error: the ranks agreed on who reports it, as `python train.py` does, so
                # a rank-specific error is printed by its rank (a bug keeps its traceback).
                from d9d.trainer.faults.reporting import report_job_error

                if not report_job_error(exc):
                    raise
                sys.exit(EXIT_ERROR)
            if not _is_user_error(exc):
                raise
            if os.environ.get("RANK", "0") == "0":  # every rank sees the same error; say it once
                from d9d.mesh import one_line  # torch-free; not at import, so `--help` stays lean

                click.echo(f"error: {one_line(exc)}", err=True)
            elif _met_by_every_rank(exc):
                # Under torchrun the first rank to exit gets the others killed: had this rank exited
                # at once, rank 0 could be killed before it printed the error. Wait for it instead.
                time.sleep(PEER_ERROR_GRACE_S)
            sys.exit(EXIT_ERROR)

    return wrapper


def _met_by_every_rank(exc: BaseException) -> bool:
    """Whether every rank raises this error alike, so that rank 0 reports it for all (a job's errors,
    once d9d.trainer is imported, are reported by `report_job_error` instead)."""
    return isinstance(exc, CliError | ValueError)


def _debug() -> bool:
    ctx = click.get_current_context(silent=True)
    obj: Any = ctx.find_root().obj if ctx is not None else None
    return bool(obj and obj.get("debug"))
