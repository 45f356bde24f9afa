"""`RunLock`: one job at a time per run directory, through `flock` on `<run_dir>/.lock`.

The lock is held by rank 0 for the life of the job; the kernel releases it when the process exits,
however it exits (SIGKILL included), so a crashed job never leaves a stale lock behind. Under
torchrun only rank 0 takes it and broadcasts the outcome, so every rank refuses together.
"""

import contextlib
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

    def __init__(self, fd: int | None, run_dir: Path | None = None, created: tuple[Path, ...] = ()) -> None:
        self._fd = fd
        self._run_dir = run_dir
        self._created = created  # the directories `acquire` made, deepest first

    @classmethod
    def acquire(cls, run_dir: Path, context: DistributedContext) -> "RunLock":
        """Take the lock of `run_dir` (collective under torchrun), creating the directory if needed.

        Raises:
            RunLockedError: on every rank, when another live job holds the lock.
            TrainingError: on every rank, when the run directory cannot be created or opened.
        """
        fd: int | None = None
        error: tuple[bool, str] | None = None  # (locked by another job, message)
        created: tuple[Path, ...] = ()
        if context.is_main_process:
            created = tuple(p for p in (run_dir, *run_dir.parents) if not p.exists())  # innermost first
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
        return cls(fd, run_dir, created)

    def release(self) -> None:
        """Give the lock up (safe to call twice).

        A run directory that holds nothing but the lock (a job that stopped before it wrote anything:
        a tracker that could not start, an error in the first step) is removed with the lock, and so
        are the directories above it that `acquire` created: a job that did not start leaves nothing.
        """
        if self._fd is None:
            return
        try:
            if self._run_dir is not None and _holds_only_the_lock(self._run_dir):
                (self._run_dir / LOCK_FILE).unlink(missing_ok=True)
                _remove_empty_tree(self._run_dir)
                for directory in self._created[1:]:  # the run directory's parents it created, inner first
                    with contextlib.suppress(OSError):
                        directory.rmdir()  # only when empty: another run may have appeared there
        finally:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None


def _holds_only_the_lock(run_dir: Path) -> bool:
    """Nothing in `run_dir` but the lock file and empty directories."""
    try:
        entries = list(run_dir.iterdir())
    except OSError:
        return False
    return all(
        e.name == LOCK_FILE or (e.is_dir() and not e.is_symlink() and _is_empty_tree(e)) for e in entries
    )


def _is_empty_tree(directory: Path) -> bool:
    return all(e.is_dir() and not e.is_symlink() and _is_empty_tree(e) for e in directory.iterdir())


def _remove_empty_tree(directory: Path) -> None:
    """Remove `directory` and the empty directories under it (it holds no file)."""
    for child in directory.iterdir():
        _remove_empty_tree(child)
    with contextlib.suppress(OSError):
        directory.rmdir()


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
