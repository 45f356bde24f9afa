"""The exception type of d9d.parallel.pipeline."""

from d9d.mesh import D9dError

__all__ = ["PipelineError"]


class PipelineError(D9dError, ValueError):
    """A pipeline layout, schedule or step was asked for something it cannot do (the message says what)."""
