"""`CheckpointManager`: save, find, load and prune the checkpoints of one run, crash-safely.

Model and optimizer state go through torch.distributed.checkpoint (each rank writes its own shards;
any number of ranks, or one plain process, can read them back). The caller's small extra state
(step, data state, LR scheduler, RNG, config) goes into a msgpack file, plus one optional file per
rank. A save is written into `.save-<step>.tmp-<id>/`; once every rank finished writing, rank 0 writes
the commit marker, renames the directory to `save-<step>/` and fsyncs the run directory. Only then
are older checkpoints beyond `num_to_keep` and leftovers of crashed saves removed, in the background
(`retention.py`). Each rank checksums the files it wrote (`integrity.py`); before committing, rank 0
checks that it sees every rank's files (`visibility.py`: a `save_dir` not shared by all nodes fails
the save) and records the checksums. A full disk in any layer fails the save as such (`_failure.py`).
An asynchronous save stages into reused host buffers (`staging.py`); a load is validated, and with
`verify_on_load` its checksums verified while it loads, each rank its share (`integrity.py`).
"""

import concurrent.futures
import contextlib
import datetime
import importlib.metadata
import os
import uuid
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: caught by name
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from d9d.ckpt.checkpoint._failure import Failure, describe, disk_full_error
from d9d.ckpt.checkpoint._fs import fsync_dir, remove, write_durable
from d9d.ckpt.checkpoint._group import CheckpointGroup
from d9d.ckpt.checkpoint._testhooks import (  # re-exported: crash tests import the hooks from here
    PAUSE_BEFORE_COMMIT_ENV,
    PAUSE_IN_PRUNE_ENV,  # noqa: F401
    pause_for_test,
)
from d9d.ckpt.checkpoint.best import KeepBest
from d9d.ckpt.checkpoint.errors import CheckpointDamagedError, CheckpointError, SaveDirNotSharedError
from d9d.ckpt.checkpoint.extra import decode_state, encode_state
from d9d.ckpt.checkpoint.integrity import (
    BackgroundVerification,
    CheckpointReport,
    WrittenFile,
    check_keys,
    checksum_bytes,
    inspect_checkpoint,
    problem_report,
)
from d9d.ckpt.checkpoint.layout import (
    COMMIT_FILE,
    EXTRA_FILE,
    FORMAT_VERSION,
    CheckpointInfo,
    CheckpointMeta,
    list_checkpoints,
    rank_file_name,
    recovery_hint,
    stale_dirs,
    step_dir_name,
    temp_dir_name,
    trash_dir_name,
    uncommitted_step_dirs,
)
from d9d.ckpt.checkpoint.retention import Retention
from d9d.ckpt.checkpoint.staging import HostStaging
from d9d.ckpt.checkpoint.storage import ChecksummingWriter, KnownMetadataReader
from d9d.ckpt.checkpoint.visibility import collect_files
from d9d.mesh import DistributedContext, get_logger

__all__ = ["CheckpointManager", "LoadedCheckpoint"]

_log = get_logger("d9d.ckpt")


def _uncommitted_message(run_dir: Path, damaged: list[Path]) -> str:
    names = ", ".join(str(path) for path in damaged)
    return (
        f"{names}: no valid {COMMIT_FILE}, so a damaged checkpoint or one not written by d9d; it is neither "
        f"loaded nor replaced. Move it out of {run_dir} ({recovery_hint(damaged[0])}), or use another "
        "trainer.run.name"
    )


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What `CheckpointManager.load` read besides the model and optimizer state.

    Attributes:
        rank_state: this rank's `rank_state` from the save, or None when none was saved or the
            checkpoint was written by a different number of ranks (per-rank state such as RNG does
            not carry over to another layout).
    """

    info: CheckpointInfo
    extra_state: dict[str, Any]
    rank_state: dict[str, Any] | None

    @property
    def step(self) -> int:
        """The step the checkpoint was saved at."""
        return self.info.step


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
        self._save_dir = Path(os.path.abspath(save_dir))
        self._run_dir = Path(save_dir) / run_name
        self._verify_on_load = verify_on_load
        self._num_to_keep = num_to_keep
        self._async = async_save
        self._mesh = msgspec.structs.asdict(context.config) if context is not None else None
        self._group = CheckpointGroup.create(distributed)
        # Every rank must name the temporary directory of a save alike: one id per manager + a counter.
        self._manager_id: str = self._group.broadcast(uuid.uuid4().hex[:8])
        self._seq = 0
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[CheckpointInfo] | None = None
        self._staging = HostStaging(reuse=reuse_staging)
        self._retention = Retention(self._run_dir, num_to_keep, keep_best)  # runs on rank 0 only
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
            raise CheckpointError(_uncommitted_message(self._run_dir, damaged))

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

        def read() -> dict[str, Any]:
            try:
                return decode_state((info.path / EXTRA_FILE).read_bytes(), f"{info.path.name}/{EXTRA_FILE}")
            except (CheckpointError, OSError):
                return {}

        state: dict[str, Any] = self._group.broadcast(read() if self._group.rank == 0 else None)
        return state

    @property
    def pending(self) -> bool:
        """True while an asynchronous save has not been waited for."""
        return self._pending is not None

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
        self.wait()
        save_id = f"{self._manager_id}{self._seq:04x}"
        self._seq += 1
        tmp = self._run_dir / temp_dir_name(step, save_id)
        error: Failure | None = None
        state: dict[str, Any] = {}
        own_files: dict[str, WrittenFile] = {}  # this rank's msgpack files: (size, checksum)
        try:
            step_dir_name(step)  # validates the step
            state = _live_state(model, optimizer, trainable_only=trainable_only)
            extra = encode_state(extra_state or {}, "extra_state")
            own = encode_state(rank_state, "rank_state") if rank_state is not None else None
            tmp.mkdir(parents=True, exist_ok=True)
            for name, data in ((EXTRA_FILE, extra if self._group.rank == 0 else None),
                               (rank_file_name(self._group.rank), own)):  # fmt: skip
                if data is not None:
                    write_durable(tmp / name, data)
                    own_files[name] = (len(data), checksum_bytes(data))
        except Exception as exc:
            error = Failure.of(exc)
        # Agree before the collective write: a rank that failed alone would leave the others hanging.
        votes = self._group.all_gather((step, error))
        if any(e is not None for _, e in votes):
            self._discard(tmp)
        self._raise_first_error(votes, f"saving checkpoint step {step}", step)
        if len({s for s, _ in votes}) != 1:
            raise CheckpointError(f"ranks disagree on the step to save: {[s for s, _ in votes]}")

        meta = {
            "world_size": self._group.world_size,
            "has_optimizer": optimizer is not None,
            "trainable_only": trainable_only,
            "metrics": {str(k): float(v) for k, v in metrics.items()} if metrics is not None else None,
            "metrics_step": metrics_step,
        }
        writer = ChecksummingWriter(tmp)
        if not self._async:
            try:
                with _quiet_local_dcp():
                    dcp.save(
                        state, storage_writer=writer, process_group=self._group.group, no_dist=self._local
                    )
                write_error = None
            except (Exception, CheckpointException) as exc:  # DCP's own error is a BaseException
                write_error = Failure.of(exc)
            return self._finish(step, tmp, meta, write_error, {**own_files, **writer.written})

        with _quiet_local_dcp():
            upload = dcp.async_save(
                state,
                storage_writer=writer,
                process_group=self._group.group,
                async_stager=self._staging.stager(state),
                no_dist=self._local,
            )
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="d9d-ckpt-commit")
        self._pending = self._executor.submit(self._finish_async, step, tmp, meta, upload, writer, own_files)
        return None

    def wait(self) -> CheckpointInfo | None:
        """Block until the pending asynchronous save is committed and pruning is done.

        Returns:
            The pending save's checkpoint, or None if there was none.

        Raises:
            CheckpointError: when the pending save failed (nothing was committed).
        """
        pending, self._pending = self._pending, None
        try:
            return pending.result() if pending is not None else None
        finally:
            self._retention.join()

    def poll(self) -> CheckpointInfo | None:
        """The pending asynchronous save's checkpoint once it is committed, without blocking: None while
        it writes or when none is pending; each commit is returned once (as `wait()` would).

        Raises:
            CheckpointError: when the pending save failed (nothing was committed).
        """
        pending = self._pending
        if pending is None or not pending.done():
            return None
        return self.wait()

    def _finish_async(
        self,
        step: int,
        tmp: Path,
        meta: dict[str, Any],
        upload: Any,
        writer: ChecksummingWriter,
        own_files: dict[str, WrittenFile],
    ) -> CheckpointInfo:
        try:
            upload.result()
            write_error = None
        except (Exception, CheckpointException) as exc:
            write_error = Failure.of(exc)
        return self._finish(step, tmp, meta, write_error, {**own_files, **writer.written})

    def _finish(
        self,
        step: int,
        tmp: Path,
        meta: dict[str, Any],
        write_error: Failure | None,
        written: dict[str, WrittenFile],
    ) -> CheckpointInfo:
        """Commit once every rank wrote its part; runs on all ranks (in the background when async).

        `written`: the files this rank wrote, with their sizes and checksums.
        """
        votes = self._group.all_gather((step, write_error, written))
        if any(error is not None for _, error, _ in votes):
            self._discard(tmp)
        self._raise_first_error([(s, e) for s, e, _ in votes], f"writing checkpoint step {step}", step)
        result: tuple[CheckpointInfo | None, Failure | None] = (None, None)
        if self._group.rank == 0:
            try:
                pause_for_test(PAUSE_BEFORE_COMMIT_ENV, step)
                result = (self._commit(step, tmp, meta, [w for _, _, w in votes]), None)
            except Exception as exc:  # every rank must hear of it, else they wait forever
                result = (None, Failure.of(exc))
                _remove_quietly(tmp)  # never loadable; as `_discard`, before the others hear of it
        info, failure = self._group.broadcast(result)  # also the barrier after the commit
        if info is not None:
            return info
        self._remove_own_copy(tmp)
        if failure.no_space:
            raise disk_full_error(step, self._run_dir, 0, failure.text)
        if failure.not_shared:
            raise SaveDirNotSharedError(failure.text)
        raise CheckpointError(f"committing {tmp} as {step_dir_name(step)} failed: {failure.text}")

    def _discard(self, tmp: Path) -> None:
        """Remove a failed save's partial files (collective): a full disk gets its space back at once."""
        if self._group.rank == 0:
            _remove_quietly(tmp)
        self._group.broadcast(None)  # rank 0 removed it before any other rank looks
        self._remove_own_copy(tmp)

    def _remove_own_copy(self, tmp: Path) -> None:
        """After rank 0 removed a failed save: what is still there on a node-local `save_dir` is this rank's."""
        if self._group.rank != 0 and tmp.exists():
            _remove_quietly(tmp)

    def _raise_first_error(self, votes: list[tuple[int, Failure | None]], doing: str, step: int) -> None:
        failed = [(rank, error) for rank, (_, error) in enumerate(votes) if error is not None]
        for rank, error in failed:
            if error.no_space:  # a full disk is named as such, whichever rank met it first
                raise disk_full_error(step, self._run_dir, rank, error.text)
        for rank, error in failed:
            raise CheckpointError(
                f"{doing} failed on rank {rank}: {error.text}; the previous checkpoint stays the latest"
            )

    def _commit(
        self, step: int, tmp: Path, meta: dict[str, Any], reported: list[dict[str, WrittenFile]]
    ) -> CheckpointInfo:
        written = collect_files(tmp, reported, self._save_dir)  # every rank's files visible here?
        files = {name: size for name, (size, _) in written.items()}
        record = CheckpointMeta(
            step=step,
            created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            d9d_ckpt_version=_package_version(),
            torch_version=str(torch.__version__),
            world_size=meta["world_size"],
            mesh=self._mesh,
            has_optimizer=meta["has_optimizer"],
            trainable_only=meta["trainable_only"],
            metrics=meta["metrics"],
            metrics_step=meta["metrics_step"],
            files=files,
            checksums={name: checksum for name, (_, checksum) in written.items()},
        )
        write_durable(tmp / COMMIT_FILE, msgspec.json.format(msgspec.json.encode(record)))
        fsync_dir(tmp)
        final = self._run_dir / step_dir_name(step)
        replaced = None
        if final in uncommitted_step_dirs(self._run_dir):
            raise CheckpointError(_uncommitted_message(self._run_dir, [final]))
        # Saving a step again replaces it (e.g. after resuming from an older checkpoint): the old one
        # moves aside first, since a rename cannot replace a non-empty directory.
        if final.exists() or final.is_symlink():
            replaced = self._run_dir / trash_dir_name(step, uuid.uuid4().hex[:12])
            os.rename(final, replaced)
        os.rename(tmp, final)
        fsync_dir(self._run_dir)
        _log.info("checkpoint committed", step=step, path=str(final))
        # Only now that the new checkpoint is durable may older ones go, off the training path.
        self._retention.after_commit(keep=final, step=step, replaced=replaced)
        return CheckpointInfo(step=step, path=final, meta=record)

    def remove_leftovers(self) -> list[Path]:
        """Delete what crashed saves and deletions left in the run directory; the paths removed.

        Not collective: call it on one rank, and only while no other job writes the run (the trainer
        holds the run lock). Saves do this themselves after each commit.
        """
        self._retention.join()
        removed = []
        for leftover in stale_dirs(self._run_dir):
            remove(leftover)
            removed.append(leftover)
            _log.info("removed leftover of an unfinished save", path=str(leftover))
        return removed

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
        if optimizer is not None and not info.meta.has_optimizer:
            raise CheckpointError(
                f"checkpoint {info.path} holds no optimizer state (it was saved without one); "
                "load it with optimizer=None"
            )

        report: CheckpointReport = self._group.broadcast(
            inspect_checkpoint(info, with_metadata=model is not None) if self._group.rank == 0 else None
        )
        verification: BackgroundVerification | None = None
        if self._verify_on_load and info.meta.checksums is None and self._group.rank == 0:
            _log.warning(
                "checkpoint has no checksums (saved before d9d recorded them): its files are not verified",
                step=info.step,
                path=str(info.path),
            )
        elif self._verify_on_load and not report.problems:
            # each rank checksums its share of the files while the load below reads them
            verification = BackgroundVerification(info, self._group.rank, self._group.world_size)
        damage = list(report.problems)  # damaged files: the checkpoint itself is broken
        problems: list[str] = []  # the checkpoint does not fit the model
        extra = report.extra_state
        own: dict[str, Any] | None = None
        if not damage:
            own_name = rank_file_name(self._group.rank)
            if info.meta.world_size == self._group.world_size and own_name in info.meta.files:
                try:
                    own = decode_state((info.path / own_name).read_bytes(), f"{info.path.name}/{own_name}")
                except (CheckpointError, OSError) as exc:
                    damage.append(str(exc))

        state: dict[str, Any] = {}
        stored_keys: list[str] = []
        live: dict[str, Any] = {}
        metadata = report.metadata
        if model is not None and not damage:
            if metadata is None:
                damage.append(str(report.metadata_error))
            else:
                try:
                    state = _live_state(
                        model, optimizer, info.meta.format, trainable_only=info.meta.trainable_only
                    )
                except Exception as exc:
                    problems.append(f"the model's state dict cannot be built: {describe(exc)}")
                else:
                    live, _ = flatten_state_dict(state)
                    problems += check_keys(live, metadata)
                    stored_keys = sorted(
                        k for k in metadata.state_dict_metadata if k.split(".", 1)[0] in state
                    )

        gathered = self._group.all_gather((damage, problems))
        damaged = list(dict.fromkeys(p for rank_damage, _ in gathered for p in rank_damage))
        refused = bool(damaged) or any(rank_problems for _, rank_problems in gathered)
        if refused and verification is not None:  # refused before the load: its checksums add nothing
            verification.result()
            verification = None
        if damaged:
            hint = self._group.broadcast(recovery_hint(info.path) if self._group.rank == 0 else None)
            raise CheckpointDamagedError(problem_report(info.path, damaged, hint))
        merged = list(dict.fromkeys(p for _, rank_problems in gathered for p in rank_problems))
        if not merged and model is not None:
            # Keys of the loaded sections that the checkpoint holds but no rank asked for.
            wanted = self._group.any_true(torch.tensor([k in live for k in stored_keys], dtype=torch.bool))
            merged = [
                f"unexpected key {k}: the checkpoint holds it, the model does not expect it"
                for k, hit in zip(stored_keys, wanted.tolist(), strict=True)
                if not hit
            ]
        if merged:
            raise CheckpointError(problem_report(info.path, merged, damaged=False))

        if model is not None and metadata is not None:
            try:
                with _quiet_local_dcp():
                    dcp.load(
                        state,
                        storage_reader=KnownMetadataReader(info.path, metadata),
                        process_group=self._group.group,
                        no_dist=self._local,
                    )
                options = _options(info.meta.format, trainable_only=info.meta.trainable_only)
                if optimizer is None:
                    set_model_state_dict(model, state["model"], options=options)
                else:
                    set_state_dict(
                        model,
                        optimizer,
                        model_state_dict=state["model"],
                        optim_state_dict=state["optimizer"],
                        options=options,
                    )
            except Exception as exc:
                raise CheckpointDamagedError(
                    f"reading checkpoint {info.path} failed after it passed its checks "
                    f"({type(exc).__name__}: {exc}); the model state is undefined: load again, or "
                    f"{recovery_hint(info.path)}"
                ) from exc
        found = self._verified(verification)
        if found:
            hint = self._group.broadcast(recovery_hint(info.path) if self._group.rank == 0 else None)
            raise CheckpointDamagedError(problem_report(info.path, found, hint, loaded=model is not None))
        _log.info("checkpoint loaded", step=info.step, path=str(info.path))
        return LoadedCheckpoint(info=info, extra_state=extra, rank_state=own)

    def _verified(self, verification: BackgroundVerification | None) -> list[str]:
        """Every rank's checksum problems, once each rank's verification thread ended (collective)."""
        mine = verification.result() if verification is not None else []
        if not self._verify_on_load:
            return mine
        return list(dict.fromkeys(p for rank in self._group.all_gather(mine) for p in rank))

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Wait for a pending save, then release the background thread and process group."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._retention.join()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
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

    @property
    def _local(self) -> bool:
        return self._group.is_local

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the checkpoint manager of {self._run_dir} is closed")


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.exists():
            remove(path)


def _options(checkpoint_format: int, *, trainable_only: bool = False) -> StateDictOptions:
    """How the optimizer state is laid out: flattened per parameter name from format 2 on.

    Flattened, every parameter's state and hyperparameters have keys of their own, so ranks that hold
    other parameters (another pipeline degree or schedule) each load their own; nested (format 1),
    the parameter groups are one object that only fits the layout that wrote it. `trainable_only`:
    frozen parameters are neither written nor loaded (so loading is not strict about them).
    """
    return StateDictOptions(
        flatten_optimizer_state_dict=checkpoint_format >= 2,
        ignore_frozen_params=trainable_only,
        strict=not trainable_only,
    )


def _live_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    checkpoint_format: int = FORMAT_VERSION,
    *,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """The sharded (DTensor where distributed) state dicts to write from or load into."""
    options = _options(checkpoint_format, trainable_only=trainable_only)
    if optimizer is None:
        return {"model": _without_frozen(model, get_model_state_dict(model, options=options), trainable_only)}
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {"model": _without_frozen(model, model_state, trainable_only), "optimizer": optim_state}


def _without_frozen(model: nn.Module, state: dict[str, Any], trainable_only: bool) -> dict[str, Any]:
    """`state` less every frozen parameter's key. torch's `ignore_frozen_params` misses the second name
    of a shared parameter (a tied LM head: `lm_head.weight` is `embed_tokens.weight`), which would put
    a whole vocabulary table into every adapter checkpoint."""
    if not trainable_only:
        return state
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {key: value for key, value in state.items() if key not in frozen}


def _package_version() -> str:
    try:
        return importlib.metadata.version("d9d-ckpt")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@contextlib.contextmanager
def _quiet_local_dcp() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process: that is what local mode means."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
