"""Exception types of the trainer: each message says what stopped the job, where, and what to do."""

from dataclasses import dataclass
from typing import Literal

from d9d.mesh import D9dError, first_line

__all__ = [
    "ConfigError",
    "ErrorVerdict",
    "OutOfMemoryError",
    "PeerFailedError",
    "RunLockedError",
    "TrainingError",
    "attach_verdict",
    "is_out_of_memory",
    "step_out_of_memory",
    "verdict_of",
]

_OOM_TEXT = ("out of memory", "not enough memory", "can't allocate memory", "defaultcpuallocator")


class ConfigError(D9dError, ValueError):
    """A job config cannot be used as written; the message names the key path and the fix."""


class TrainingError(D9dError, RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the last committed checkpoint stays latest."""


class PeerFailedError(TrainingError):
    """Another rank failed first; the message is that rank's own error, so it can be reported once.

    Attributes:
        rank: the rank that failed first.
    """

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class RunLockedError(TrainingError):
    """Another job is running with the same `save_dir/run.name`; two jobs must not write one run."""


class OutOfMemoryError(TrainingError):
    """The model or a step does not fit in the device's memory (the message says what to change)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's CUDA OOM, Python's MemoryError, or a CPU allocator failure."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc).lower() for text in _OOM_TEXT)


def step_out_of_memory(
    exc: BaseException, device: object, step: int, snapshot: object = None
) -> OutOfMemoryError:
    """The one error of a step that ran out of `device` memory: what to change, and the memory
    snapshot written for it (`snapshot`, a path) when there is one."""
    seen = f"; memory snapshot: {snapshot}" if snapshot is not None else ""
    return OutOfMemoryError(
        f"out of {device} memory in step {step} ({first_line(exc)}); lower data.microbatch_size, set "
        "trainer.activation_checkpointing.mode: full, or shard the model over more ranks" + seen
    )


@dataclass(frozen=True)
class ErrorVerdict:
    """Who reports a failed rank's error: `shared` (every rank raised the same text: rank 0 says it),
    `mine` (this rank's own error: it says it, with its rank) or `peer` (another rank's error came
    first: this rank stays quiet). The ranks agree on it in `d9d.trainer.faults.failures`; it lives here,
    without torch, for the reporting of errors raised before torch is imported (a bad config)."""

    kind: Literal["shared", "mine", "peer"]
    origin: int | None = None


_VERDICT_ATTR = "_d9d_verdict"


def verdict_of(exc: BaseException) -> ErrorVerdict | None:
    """The verdict attached to `exc` by `agree_on_error` or the FailureBoard, if any."""
    return getattr(exc, _VERDICT_ATTR, None)


def attach_verdict(exc: BaseException, verdict: ErrorVerdict) -> None:
    """Attach the ranks' verdict to `exc`, for `verdict_of` (and so the report) to find."""
    setattr(exc, _VERDICT_ATTR, verdict)
