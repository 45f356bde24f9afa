"""The exception types of d9d checkpoints: one base type, and the failures a caller may tell apart."""

from d9d.mesh import D9dError

__all__ = ["CheckpointDamagedError", "CheckpointDiskFullError", "CheckpointError", "SaveDirNotSharedError"]


class CheckpointError(D9dError, RuntimeError):
    """A checkpoint could not be saved, found or loaded; the message names the directory and the key."""


class CheckpointDiskFullError(CheckpointError):
    """A save ran out of space (ENOSPC, from any layer); nothing was committed."""


class SaveDirNotSharedError(CheckpointError):
    """A save's files are not all visible to the committing rank: `save_dir` is not shared by all nodes."""


class CheckpointDamagedError(CheckpointError):
    """A committed checkpoint's files are missing, truncated or fail their checksum; nothing was loaded."""
