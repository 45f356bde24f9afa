"""How a job's error reaches the user: one `error: ...` line, printed once, and a non-zero exit.

Used by `python train.py` (`d9d.trainer.main`) and `d9d train`. Who prints is decided by agreement,
never by the error's type: the failed ranks compare their error text through the launch's store
(`d9d.trainer.faults.failures.agree_on_error`). An error every rank raised alike (a bad config, a launch that
does not fit the mesh, the same missing file everywhere) is printed by rank 0, while the other ranks
wait a moment before they exit (under torchrun the first rank to exit gets the others killed, and
rank 0 must get to print first). An error of one rank (a path that only one node lacks) is printed
by that rank, naming it; the ranks that only saw its consequence (a broken collective) stay quiet.
"""

import json
import os
import re
import sys
import time

from d9d.mesh import D9dError, one_line
from d9d.trainer.errors import verdict_of

__all__ = ["PEER_ERROR_GRACE_S", "is_shared_by_every_rank", "report_error", "report_job_error"]

#: Seconds a rank other than 0 waits before exiting on an error that rank 0 reports.
PEER_ERROR_GRACE_S = 10.0

_NAMES_A_RANK = re.compile(r"^rank \d+\b")


def is_shared_by_every_rank(exc: BaseException) -> bool:
    """Whether rank 0 reports this error for every rank (the ranks agreed it is the same everywhere).

    Without a verdict (local mode, or no store to compare through) rank 0 reports.
    """
    verdict = verdict_of(exc)
    return verdict is None or verdict.kind == "shared"


def with_rank(text: str, rank: int | str) -> str:
    """`rank N: text`, unless the text names a rank already."""
    return text if _NAMES_A_RANK.match(text) else f"rank {rank}: {text}"


def report_error(exc: BaseException) -> None:
    """Print `error: <message>` on stderr once for the job (see the module docstring).

    Under torchrun the rank that prints also records the line as its error file, so torchrun's
    failure summary shows it as the root cause instead of `<N/A>`.
    """
    rank = os.environ.get("RANK", "0")
    verdict = verdict_of(exc)
    if verdict is not None and verdict.kind == "mine" and os.environ.get("WORLD_SIZE", "1") != "1":
        _say(f"error: {with_rank(one_line(exc), rank)}")
    elif verdict is not None and verdict.kind == "peer":
        return  # the rank that failed first says why
    elif rank == "0":
        _say(f"error: {one_line(exc)}")
    else:
        time.sleep(PEER_ERROR_GRACE_S)


def report_job_error(exc: BaseException) -> bool:
    """Report a job's error as `python train.py` and `d9d train` do, when it is a user's to fix.

    A user's error is a `D9dError` (a bad config, launch, checkpoint, ...) or an `OSError` (a path),
    or the consequence on this rank of another rank's failure; it becomes the job's one `error:` line
    (`report_error`). Anything else is a bug: nothing is printed and False returned, for the caller
    to re-raise with its traceback.
    """
    verdict = verdict_of(exc)
    if not isinstance(exc, D9dError | OSError) and (verdict is None or verdict.kind != "peer"):
        return False
    report_error(exc)
    return True


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    record_for_torchrun(line)


def record_for_torchrun(message: str) -> None:
    """Write `message` as this rank's torchelastic error file (`TORCHELASTIC_ERROR_FILE`), if there is one.

    torchrun names the failed rank with the earliest error as the root cause and prints the file's
    message in its summary. Best effort: a file that cannot be written changes nothing else.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as file:
            json.dump({"message": message, "timestamp": int(time.time())}, file)
    except OSError:
        pass
