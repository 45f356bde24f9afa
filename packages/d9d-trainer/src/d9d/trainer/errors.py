"""Exception types of the trainer: each message says what stopped the job, where, and what to do."""

from d9d.mesh import D9dError

__all__ = [
    "OutOfMemoryError",
    "PeerFailedError",
    "RunLockedError",
    "TrainingError",
    "is_out_of_memory",
    "step_out_of_memory",
]

_OOM_TEXT = ("out of memory", "not enough memory", "can't allocate memory", "defaultcpuallocator")


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


def first_line(exc: BaseException) -> str:
    """The first line of the message (allocator errors are long)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:200]
