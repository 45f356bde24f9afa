"""Exception type of the safetensors IO."""

from d9d.mesh import D9dError

__all__ = ["SafetensorsIOError"]


class SafetensorsIOError(D9dError, RuntimeError):
    """A safetensors folder is missing, inconsistent or does not fit the target (names the file and key)."""
