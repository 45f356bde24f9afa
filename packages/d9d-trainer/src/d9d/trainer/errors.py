"""Exception types of the trainer: each message says what stopped the job, where, and what to do."""

from d9d.mesh import D9dError

__all__ = ["PeerFailedError", "RunLockedError", "TrainingError"]


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
