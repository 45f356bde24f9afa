"""The one exception type of d9d checkpoints."""

from d9d.mesh import D9dError

__all__ = ["CheckpointError"]


class CheckpointError(D9dError, RuntimeError):
    """A checkpoint could not be saved, found or loaded; the message names the directory and the key."""
