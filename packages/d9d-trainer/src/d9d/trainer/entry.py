"""`run_job` and `main`: the one code path behind `python train.py config.yaml` and `d9d train`."""

import sys
from collections.abc import Sequence
from pathlib import Path

from d9d.mesh import D9dError
from d9d.trainer.reporting import report_error
from d9d.trainer.trainer import Trainer, TrainResult

__all__ = ["main", "run_job"]


def run_job(config_path: str | Path, overrides: Sequence[str] = ()) -> TrainResult:
    """Load the config, build the job, train (resuming if the run has checkpoints), export if set."""
    trainer = Trainer.from_config(config_path, overrides)
    with trainer:
        result = trainer.train()
        if trainer._job.config.export.dir is not None:
            trainer.export()
    return result


def main(argv: Sequence[str] | None = None) -> None:
    """`python train.py CONFIG [key.path=value ...]`: run the job; errors are one line and exit 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: python train.py CONFIG.yaml [key.path=value ...]", file=sys.stderr)
        sys.exit(0 if args else 2)
    overrides = [a.removeprefix("--set=") for a in args[1:] if a != "--set"]
    try:
        run_job(args[0], overrides)
    except (D9dError, OSError) as exc:
        report_error(exc)
        sys.exit(2)
