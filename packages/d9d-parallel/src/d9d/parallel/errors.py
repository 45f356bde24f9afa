"""Exception types of d9d.parallel."""

from d9d.mesh import D9dError

__all__ = ["ParallelizeError", "SleepError", "UnsupportedParallelismError"]


class ParallelizeError(D9dError, ValueError):
    """A parallelize call got a mesh, axis or option it cannot use (the message names it)."""


class UnsupportedParallelismError(D9dError, NotImplementedError):
    """The mesh asks for a parallelism d9d does not implement yet (e.g. context parallelism)."""


class SleepError(D9dError, RuntimeError):
    """Sleep or wake of the training state out of order, or a forward or step while it sleeps."""
