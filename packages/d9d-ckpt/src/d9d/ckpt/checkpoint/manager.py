"""`CheckpointManager`: save, find, load and prune the checkpoints of one run, crash-safely.

Model and optimizer state go through torch.distributed.checkpoint (each rank writes its own shards;
any number of ranks, or one plain process, can read them back). The caller's small extra state
(step, data state, LR scheduler, RNG, config) goes into a msgpack file, plus one optional file per
rank. The manager composes the owners of each part and wires them once:

- `commit.py`: a save, sync or async; every rank writes into `.save-<step>.tmp-<id>/`, rank 0
  commits it as `save-<step>/` once every rank finished (a full disk in any layer fails the save as
  such, `_failure.py`; a `save_dir` not shared by all nodes too, `visibility.py`).
- `retention.py`: after each commit, older checkpoints beyond `num_to_keep` and leftovers of crashed
  saves are removed in the background.
- `load.py`: a load is checked on every rank before anything is read, and with `verify_on_load` its
  checksums verified while it loads, each rank its share (`integrity.py`).
- `staging.py`: the host buffers an asynchronous save stages into; `state_dicts.py`: the state dicts
  both directions use.
"""

import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch import nn

from d9d.ckpt.checkpoint._group import CheckpointGroup
from d9d.ckpt.checkpoint.best import KeepBest
from d9d.ckpt.checkpoint.commit import Committer
from d9d.ckpt.checkpoint.errors import CheckpointError
from d9d.ckpt.checkpoint.layout import (
    CheckpointInfo,
    list_checkpoints,
    uncommitted_message,
    uncommitted_step_dirs,
)
from d9d.ckpt.checkpoint.load import LoadedCheckpoint, Loader
from d9d.ckpt.checkpoint.retention import Retention, remove_leftovers
from d9d.ckpt.checkpoint.staging import HostStaging
from d9d.mesh import DistributedContext

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Checkpoints of one run in `<save_dir>/<run_name>/save-<step>/`.

    Every rank of the job creates the manager (collective: it builds a gloo group of its own for
    checkpoint traffic) and calls `save` and `load` together; `latest()` and `checkpoints()` only
    read the directory. One manager (one job) writes a run directory at a time. With `async_save=True`,
    `save` returns once the state is copied to CPU memory and the write overlaps the next steps; the
    checkpoint is committed when the write finished on every rank. Call `wait()` (or `close()`)
    before the job exits. A later `save` or `load` waits for the previous save first. Checkpoints
    beyond `num_to_keep` are deleted on a background thread after each commit; `wait()`, `close()`,
    the next save and the listing methods wait for that too.

    Args:
        save_dir: the directory holding the runs (must be shared by all nodes).
        run_name: the run's own subdirectory.
        num_to_keep: how many of the newest committed checkpoints to keep (None keeps all).
        keep_best: also keep the best checkpoints by a metric their commit records hold (`save(metrics=)`);
            never deletes the newest ones `num_to_keep` keeps (see `best.py`).
        async_save: overlap writing with training.
        context: the job's distributed context; None uses the default process group if one exists,
            else one plain process.
        reuse_staging: with `async_save`, keep the host copy of the state between saves (pinned
            memory when the state is on CUDA), so that each save stalls training for one
            device-to-host copy into the same buffers. It holds one copy of this rank's state in host
            memory until `close()`; False allocates a fresh pageable copy per save.
        verify_on_load: while a load reads the checkpoint, each rank compares its share of the files
            (the shards and rank file it wrote; rank 0 the shared files) with the checksums the
            commit recorded, on a thread (finds a flipped byte; the load's wall time stays about the
            same). Damage found then raises `CheckpointDamagedError` on every rank after the load,
            whose model state is then undefined. A checkpoint saved without checksums loads with a
            warning.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        run_name: str,
        *,
        num_to_keep: int | None = None,
        keep_best: KeepBest | None = None,
        async_save: bool = False,
        context: DistributedContext | None = None,
        reuse_staging: bool = True,
        verify_on_load: bool = True,
    ) -> None:
        if not run_name or run_name in (".", "..") or "/" in run_name or os.sep in run_name:
            raise CheckpointError(f"run name {run_name!r} must be a non-empty name without path separators")
        if num_to_keep is not None and num_to_keep < 1:
            raise CheckpointError(f"num_to_keep must be >= 1 (or None to keep all), got {num_to_keep}")
        if context is not None and context.mode == "planning":
            raise CheckpointError("a planning context cannot save or load checkpoints; build one from_env")
        distributed = (
            context.mode == "distributed"
            if context is not None
            else dist.is_available() and dist.is_initialized()
        )
        self._run_dir = Path(save_dir) / run_name
        self._group = CheckpointGroup.create(distributed)
        self._staging = HostStaging(reuse=reuse_staging)
        self._retention = Retention(self._run_dir, num_to_keep, keep_best)  # runs on rank 0 only
        self._committer = Committer(
            self._group,
            self._run_dir,
            Path(os.path.abspath(save_dir)),
            self._retention,
            self._staging,
            async_save=async_save,
            mesh=msgspec.structs.asdict(context.config) if context is not None else None,
        )
        self._loader = Loader(self._group, verify_on_load=verify_on_load)
        self._closed = False

    # ------------------------------------------------------------------ discovery

    @property
    def run_dir(self) -> Path:
        """`<save_dir>/<run_name>`."""
        return self._run_dir

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every committed checkpoint of the run, oldest step first (after this manager's pruning)."""
        self._retention.join()
        return list_checkpoints(self._run_dir)

    def check_uncommitted(self) -> None:
        """Refuse a run directory holding `save-<step>` directories that are not committed checkpoints.

        Raises:
            CheckpointError: naming them: d9d neither resumes past them nor overwrites them.
        """
        self._retention.join()
        damaged = uncommitted_step_dirs(self._run_dir)
        if damaged:
            raise CheckpointError(uncommitted_message(self._run_dir, damaged))

    def latest(self) -> CheckpointInfo | None:
        """The committed checkpoint with the highest step, or None when the run has none."""
        found = self.checkpoints()
        return found[-1] if found else None

    def read_extra_state(self, info: CheckpointInfo) -> dict[str, Any]:
        """The extra state of a committed checkpoint alone (collective: rank 0 reads it, every rank gets it).

        Reads one small file and checks nothing else, e.g. to compare the config a checkpoint was
        trained with before deciding what to load. An unreadable or corrupt file gives `{}`: `load`
        then reports the damage with its recovery hint.
        """
        self._check_open()
        return self._loader.read_extra_state(info)

    @property
    def pending(self) -> bool:
        """True while an asynchronous save has not been waited for."""
        return self._committer.pending

    @property
    def staging_pinned(self) -> bool:
        """True when asynchronous saves stage into pinned host memory (a CUDA state, reused buffers)."""
        return self._staging.pinned

    # ------------------------------------------------------------------ save

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        extra_state: Mapping[str, Any] | None = None,
        rank_state: Mapping[str, Any] | None = None,
        trainable_only: bool = False,
        metrics: Mapping[str, float] | None = None,
        metrics_step: int | None = None,
    ) -> CheckpointInfo | None:
        """Save the model (and optimizer) with the caller's state as checkpoint `step` (collective).

        Args:
            trainable_only: leave out the model's frozen parameters (`requires_grad=False`, e.g. the
                base weights under LoRA adapters); the checkpoint then holds the trainable ones, the
                buffers and the optimizer state, and loading restores only those (the caller rebuilds
                the frozen weights, e.g. from the base model's folder). Recorded in the commit marker.
            extra_state: plain data shared by all ranks (step, data state, LR scheduler, config);
                rank 0's copy is written.
            rank_state: plain data of this rank alone (e.g. `capture_rng_state()`).
            metrics: numbers recorded in the commit marker (`CheckpointMeta.metrics`, rank 0's copy),
                e.g. the last eval's loss, measured at `metrics_step`; `keep_best` ranks by them.

        Returns:
            The committed checkpoint, or None with `async_save` (`wait()` returns it).

        Raises:
            CheckpointError: on every rank when any rank failed; nothing is committed then and the
                previous checkpoint stays the latest.
        """
        self._check_open()
        return self._committer.save(
            step,
            model,
            optimizer,
            extra_state=extra_state,
            rank_state=rank_state,
            trainable_only=trainable_only,
            metrics=metrics,
            metrics_step=metrics_step,
        )

    def wait(self) -> CheckpointInfo | None:
        """Block until the pending asynchronous save is committed and pruning is done.

        Returns:
            The pending save's checkpoint, or None if there was none.

        Raises:
            CheckpointError: when the pending save failed (nothing was committed).
        """
        return self._committer.wait()

    def poll(self) -> CheckpointInfo | None:
        """The pending asynchronous save's checkpoint once it is committed, without blocking: None while
        it writes or when none is pending; each commit is returned once (as `wait()` would).

        Raises:
            CheckpointError: when the pending save failed (nothing was committed).
        """
        return self._committer.poll()

    def remove_leftovers(self) -> list[Path]:
        """Delete what crashed saves and deletions left in the run directory; the paths removed.

        Not collective: call it on one rank, and only while no other job writes the run (the trainer
        holds the run lock). Saves do this themselves after each commit.
        """
        self._retention.join()
        return remove_leftovers(self._run_dir)

    # ------------------------------------------------------------------ load

    def load(
        self,
        info: CheckpointInfo | None = None,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> LoadedCheckpoint:
        """Load a checkpoint (default: the latest) into the model and optimizer (collective).

        The model and optimizer may be sharded differently, or run on a different number of ranks,
        than when the checkpoint was saved. Everything is checked first (files, keys, shapes, dtypes,
        extra state), so a checkpoint that does not fit leaves the model and optimizer untouched.
        Rank 0 alone lists the run (when `info` is None), checks the files and reads the shared
        metadata, and broadcasts what it found; each rank reads only its own rank file and shards.

        Raises:
            CheckpointError: on every rank, naming the checkpoint and the offending files or keys.
        """
        self._check_open()
        self.wait()
        if optimizer is not None and model is None:
            raise CheckpointError("an optimizer can only be loaded together with its model")
        if info is None:
            info = self._group.broadcast(self.latest() if self._group.rank == 0 else None)
        if info is None:
            raise CheckpointError(f"there is no committed checkpoint in {self._run_dir}")
        return self._loader.load(info, model, optimizer)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Wait for a pending save, then release the background thread and process group."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._retention.join()
            self._committer.close()
            self._staging.close()
            self._group.destroy()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the checkpoint manager of {self._run_dir} is closed")
