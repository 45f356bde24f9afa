"""How a failed save is told to every rank: one line per rank, and whether the disk was full.

A full disk shows up in any layer of a save (DCP's writer threads, the staging copy, the msgpack
files, the commit record), wrapped differently by each; `Failure.of` finds an ENOSPC anywhere in
the exception's chain (DCP's per-rank failures, causes, contexts) so that the save fails with one
`CheckpointDiskFullError` whatever raised it.
"""

import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from d9d.ckpt.checkpoint.errors import CheckpointDiskFullError, CheckpointError, SaveDirNotSharedError

__all__ = ["Failure", "describe", "disk_full_error", "is_no_space"]

_NO_SPACE_TEXT = os.strerror(errno.ENOSPC)  # "No space left on device"


def describe(exc: BaseException) -> str:
    """One line naming the error; DCP's multi-rank report is reduced to its first underlying error."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (cause, _) = min(exc.failures.items())
        return f"{describe(cause)} (on rank {rank})"
    if isinstance(exc, CheckpointError):
        return str(exc)
    # A writer that wraps the ENOSPC (torch's zip writer: "unexpected pos ...") hides what happened:
    # name the OSError under it instead.
    target = _no_space_cause(exc) or exc
    return " ".join(f"{type(target).__name__}: {target}".split())


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and every error under it, once each: causes, contexts and DCP's per-rank failures."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, CheckpointException):
            for failure in current.failures.values():
                cause = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(cause, BaseException):
                    todo.append(cause)
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]


def _is_enospc(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno == errno.ENOSPC


def _no_space_cause(exc: BaseException) -> OSError | None:
    """The ENOSPC OSError under `exc` (not `exc` itself), if there is one."""
    found = next((e for e in _chain(exc) if e is not exc and _is_enospc(e)), None)
    return found if isinstance(found, OSError) else None


def is_no_space(exc: BaseException) -> bool:
    """Whether an ENOSPC is anywhere in `exc`'s chain (an error that lost its errno: by its text)."""
    return any(
        _is_enospc(e) or isinstance(e, CheckpointDiskFullError) or _NO_SPACE_TEXT in str(e)
        for e in _chain(exc)
    )


@dataclass(frozen=True)
class Failure:
    """What one rank tells the others about its failed part of a save (it pickles for a gather)."""

    text: str
    no_space: bool = False
    not_shared: bool = False

    @classmethod
    def of(cls, exc: BaseException) -> "Failure":
        """The failure of `exc`."""
        return cls(
            describe(exc), no_space=is_no_space(exc), not_shared=isinstance(exc, SaveDirNotSharedError)
        )


def disk_full_error(step: int, run_dir: Path, rank: int, detail: str) -> CheckpointDiskFullError:
    """The one error of a save that ran out of space, with where it happened."""
    # DCP reports every rank's failure on each rank and names the rank that failed itself.
    where = detail if "(on rank " in detail else f"rank {rank}: {detail}"
    return CheckpointDiskFullError(
        f"no space left on device while writing checkpoint step {step} to {run_dir}; the previous "
        f"checkpoint stays the latest; free space or set trainer.checkpointing.save_dir "
        f"({where})"
    )
