"""Retention: which checkpoints beyond `num_to_keep` (and the `KeepBest` ones) go, deleted off the
training path.

Kept: the `num_to_keep` newest and, with a `KeepBest` policy, its best ones by their recorded metric
(`best.py`); the checkpoint just committed is never deleted. The choice reads the commit records only,
so a prune interrupted by a crash is redone alike after the next commit.

A checkpoint is deleted only after a newer one was committed, and in two steps: renamed aside to
`.trash-save-<step>-<id>` (atomic, so it stops being a checkpoint at once), then removed; a kill in
between leaves a leftover that the next save removes. The deletion runs on a thread of the rank that
commits, so no rank waits for a slow `rmtree` on a shared file system; the next save, `wait()` and
`close()` join it first, so it never overlaps the next save's writes.
"""

import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

from d9d.ckpt.checkpoint._fs import remove
from d9d.ckpt.checkpoint._testhooks import PAUSE_IN_PRUNE_ENV, pause_for_test
from d9d.ckpt.checkpoint.best import KeepBest, best_checkpoints
from d9d.ckpt.checkpoint.layout import CheckpointInfo, list_checkpoints, stale_dirs, trash_dir_name
from d9d.mesh import get_logger

__all__ = ["Retention", "excess_checkpoints", "prune", "remove_leftovers"]

_log = get_logger("d9d.ckpt")


def excess_checkpoints(
    committed: Sequence[CheckpointInfo], keep: Path, num_to_keep: int | None, best: KeepBest | None = None
) -> list[CheckpointInfo]:
    """What of `committed` (sorted by step) to delete: all but `keep`, the `num_to_keep` newest
    (`keep` among them) and `best`'s best ones."""
    if num_to_keep is None:
        return []
    others = [info for info in committed if info.path != keep]
    excess = others[: max(len(others) + 1 - num_to_keep, 0)]
    if best is None:
        return excess
    kept = {info.path for info in best_checkpoints(committed, best)}
    return [info for info in excess if info.path not in kept]


def prune(
    run_dir: Path,
    keep: Path,
    step: int,
    num_to_keep: int | None,
    replaced: Path | None = None,
    best: KeepBest | None = None,
) -> None:
    """Delete what the commit of `keep` (checkpoint `step`) made obsolete, then crash leftovers.

    `replaced` is an older copy of the same step that the commit renamed aside.
    """
    if replaced is not None:
        remove(replaced)
    for info in excess_checkpoints(list_checkpoints(run_dir), keep, num_to_keep, best):
        trash = run_dir / trash_dir_name(info.step, uuid.uuid4().hex[:12])
        info.path.rename(trash)  # atomic: it stops being a checkpoint at once
        pause_for_test(PAUSE_IN_PRUNE_ENV, step)
        remove(trash)
        _log.info("checkpoint removed", step=info.step, kept=num_to_keep)
    remove_leftovers(run_dir)


def remove_leftovers(run_dir: Path) -> list[Path]:
    """Delete what crashed saves and deletions left in `run_dir`; the paths removed."""
    removed = []
    for leftover in stale_dirs(run_dir):
        remove(leftover)
        removed.append(leftover)
        _log.info("removed leftover of an unfinished save", path=str(leftover))
    return removed


class Retention:
    """Runs `prune` after each commit on a background thread (one at a time); `join` waits for it.

    A thread per prune, not a pool: none is left running between saves (forked test ranks and
    `fork`-based data workers must not inherit a live thread).
    """

    def __init__(self, run_dir: Path, num_to_keep: int | None, best: KeepBest | None = None) -> None:
        self._run_dir = run_dir
        self._num_to_keep = num_to_keep
        self._best = best
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the commit may run on the async-save thread

    def after_commit(self, keep: Path, step: int, replaced: Path | None = None) -> None:
        """Start pruning what the commit of `keep` made obsolete; returns at once."""
        self.join()
        thread = threading.Thread(
            target=self._run, args=(keep, step, replaced), name="d9d-ckpt-prune", daemon=False
        )
        with self._lock:
            thread.start()
            self._thread = thread

    @property
    def running(self) -> bool:
        """True while a prune has not finished."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def join(self) -> None:
        """Wait for the running prune, if any (a failed one was logged; it is retried after the next save)."""
        with self._lock:
            thread = self._thread
        if thread is None:
            return
        thread.join()
        with self._lock:
            if self._thread is thread:
                self._thread = None

    def _run(self, keep: Path, step: int, replaced: Path | None) -> None:
        try:
            prune(self._run_dir, keep, step, self._num_to_keep, replaced, self._best)
        except Exception as exc:  # the new checkpoint is safe; leftovers are retried after the next save
            _log.warning("checkpoint cleanup failed", error=str(exc))
