"""`run_job`, `run_command` and `main`: the one code path behind `python train.py config.yaml` and
`d9d train`."""

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from d9d.mesh import RendezvousError
from d9d.trainer.failures import agree_on_error, error_store, mark_own_error, verdict_of
from d9d.trainer.reporting import report_job_error
from d9d.trainer.signals import EXIT_INTERRUPTED, EXIT_PREEMPTED, INTERRUPTED_MESSAGE
from d9d.trainer.trainer import Trainer, TrainResult

__all__ = ["main", "run_command", "run_job"]


def run_job(config_path: str | Path, overrides: Sequence[str] = ()) -> TrainResult:
    """Load the config, build the job, train (resuming if the run has checkpoints), export if set.

    On a failure under a multi-process launch, the ranks first agree on who reports it (see
    `d9d.trainer.reporting`); the exception carries the verdict.
    """
    try:
        trainer = Trainer.from_config(config_path, overrides)
        with trainer:
            result = trainer.train()
            if result.stopped_by is None and trainer._job.config.export.dir is not None:
                trainer.export()  # a run stopped by a signal is unfinished: no export
        return result
    except Exception as exc:
        _agree(exc)
        raise


def run_command(config_path: str | Path, overrides: Sequence[str] = ()) -> None:
    """`run_job` with a command's exit: Ctrl-C prints how to resume and exits `EXIT_INTERRUPTED`
    (130); a run stopped and saved by SIGTERM exits `EXIT_PREEMPTED`; a finished run returns.

    Errors propagate, for the caller to report (`report_job_error`).
    """
    try:
        result = run_job(config_path, overrides)
    except KeyboardInterrupt:
        print(INTERRUPTED_MESSAGE, file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)
    if result.stopped_by is not None:  # saved after SIGTERM / Ctrl-C: run the same command to resume
        sys.exit(EXIT_PREEMPTED)


def _agree(exc: Exception) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world_size <= 1 or "RANK" not in os.environ or verdict_of(exc) is not None:
        return  # one process, or the ranks agreed already (a failed step: see FailureBoard)
    store = error_store()
    if store is not None:
        agree_on_error(exc, store, int(os.environ["RANK"]), world_size)
    elif isinstance(exc, RendezvousError):  # no store to agree through: this rank must say it itself
        mark_own_error(exc, int(os.environ["RANK"]))


def _overrides(args: Sequence[str]) -> list[str]:
    """`key=val`, `--set key=val` and `--set=key=val`, in order; a `--set` with no value after it exits 2."""
    overrides = []
    rest = iter(args)
    for arg in rest:
        if arg == "--set":
            arg = next(rest, None)
            if arg is None or arg.startswith("-"):
                print("error: --set needs an override after it: key.path=value", file=sys.stderr)
                sys.exit(2)
        overrides.append(arg.removeprefix("--set="))
    return overrides


def main(argv: Sequence[str] | None = None) -> None:
    """`python train.py CONFIG [key.path=value ...]`: run the job; errors are one line and exit 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: python train.py CONFIG.yaml [key.path=value ...]", file=sys.stderr)
        sys.exit(0 if args else 2)
    overrides = _overrides(args[1:])
    try:
        run_command(args[0], overrides)
    except Exception as exc:
        if not report_job_error(exc):
            raise  # a bug, not a user's mistake: its traceback
        sys.exit(2)
