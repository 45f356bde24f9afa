"""`RunLock`: one job at a time per run directory, through `flock` on `<run_dir>/.lock`.

The lock is held by rank 0 for the life of the job; the kernel releases it when the process exits,
however it exits (SIGKILL included), so a crashed job never leaves a stale lock behind. Under
torchrun only rank 0 takes it and broadcasts the outcome, so every rank refuses together.
"""

import datetime
import fcntl
import os
import socket
from pathlib import Path

import torch.distributed as dist

from d9d.mesh import DistributedContext
from d9d.trainer.errors import RunLockedError, TrainingError

__all__ = ["LOCK_FILE", "RunLock"]

#: Name of the lock file inside a run directory.
LOCK_FILE = ".lock"


class RunLock:
    """The exclusive lock of one run directory (held on rank 0; other ranks hold nothing)."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    @classmethod
    def acquire(cls, run_dir: Path, context: DistributedContext) -> "RunLock":
        """Take the lock of `run_dir` (collective under torchrun), creating the directory if needed.

        Raises:
            RunLockedError: on every rank, when another live job holds the lock.
            TrainingError: on every rank, when the run directory cannot be created or opened.
        """
        fd: int | None = None
        error: tuple[bool, str] | None = None  # (locked by another job, message)
        if context.is_main_process:
            try:
                fd = _try_lock(run_dir)
            except RunLockedError as exc:
                error = (True, str(exc))
            except OSError as exc:
                error = (
                    False,
                    f"cannot create the lock file of run directory {run_dir} ({exc.strerror or exc}); "
                    "set trainer.checkpointing.save_dir to a writable directory",
                )
        if context.mode == "distributed":
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            locked, message = error
            raise (RunLockedError if locked else TrainingError)(message)
        return cls(fd)

    def release(self) -> None:
        """Give the lock up (safe to call twice)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None


def _try_lock(run_dir: Path) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "unknown"
        os.close(fd)
        raise RunLockedError(
            f"run {run_dir} is in use by another job ({holder}; lock file {path}); "
            "wait for it to finish, stop it, or choose another trainer.run.name"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    since = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {since}\n".encode(), 0)
    return fd
