"""How a job's error reaches the user: one `error: ...` line, printed once, and a non-zero exit.

Used by `python train.py` (`d9d.trainer.main`) and `d9d train`. Errors that every rank raises alike
(a bad config, a launch that does not fit the mesh, a checkpoint that cannot be loaded, a training
error the ranks agreed on) are printed by rank 0 only; the other ranks wait a moment before they exit, because under
torchrun the first rank to exit gets the others killed, and rank 0 must get to print first.
"""

import os
import sys
import time

from d9d.ckpt import CheckpointError
from d9d.mesh import LaunchError
from d9d.trainer.errors import TrainingError

__all__ = ["PEER_ERROR_GRACE_S", "is_shared_by_every_rank", "one_line", "report_error"]

#: Seconds a rank other than 0 waits before exiting on an error that rank 0 reports.
PEER_ERROR_GRACE_S = 10.0


def is_shared_by_every_rank(exc: BaseException) -> bool:
    """Whether every rank raises this error alike, so that rank 0 reports it for all.

    Training errors count: the trainer agrees on them across ranks (a global non-finite loss, a
    locked run, or one rank's failure that rank 0 reports for the job).
    """
    return isinstance(exc, ValueError | LaunchError | CheckpointError | TrainingError)


def one_line(exc: BaseException) -> str:
    """The error's message on one line."""
    text = str(exc) or type(exc).__name__
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def report_error(exc: BaseException) -> None:
    """Print `error: <message>` on stderr (rank 0 only for shared errors; peers wait for it)."""
    rank = os.environ.get("RANK", "0")
    if rank == "0" or not is_shared_by_every_rank(exc):
        print(f"error: {one_line(exc)}", file=sys.stderr, flush=True)
    else:
        time.sleep(PEER_ERROR_GRACE_S)
