"""Durable file-system steps of a checkpoint: fsynced writes, directory fsyncs, removal."""

import os
import shutil
from pathlib import Path

__all__ = ["fsync_dir", "remove", "write_durable"]


def write_durable(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make the entries of a directory (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Delete a file, a link or a whole directory tree."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)
