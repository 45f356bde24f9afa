"""The crash-safe save protocol of one run: every rank writes, the ranks agree, rank 0 commits.

A save is written into `.save-<step>.tmp-<id>/`. The ranks agree twice: before the collective write
(a rank that failed alone would leave the others hanging in it) and once every rank finished
writing. Then rank 0 writes the commit marker, fsyncs it, renames the directory to `save-<step>/`,
fsyncs the run directory, and only then starts pruning (`retention.py`). A failed save is removed
and raised on every rank alike, and the previous checkpoint stays the latest. With `async_save` the
write and the commit run on a thread of their own, after one copy into host memory (`staging.py`).
"""

import concurrent.futures
import contextlib
import datetime
import importlib.metadata
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: caught by name

from d9d.ckpt.checkpoint._failure import Failure, disk_full_error
from d9d.ckpt.checkpoint._fs import fsync_dir, remove, write_durable
from d9d.ckpt.checkpoint._group import CheckpointGroup
from d9d.ckpt.checkpoint._testhooks import PAUSE_BEFORE_COMMIT_ENV, pause_for_test
from d9d.ckpt.checkpoint.errors import CheckpointError, SaveDirNotSharedError
from d9d.ckpt.checkpoint.extra import encode_state
from d9d.ckpt.checkpoint.integrity import WrittenFile, checksum_bytes
from d9d.ckpt.checkpoint.layout import (
    COMMIT_FILE,
    EXTRA_FILE,
    CheckpointInfo,
    CheckpointMeta,
    rank_file_name,
    step_dir_name,
    temp_dir_name,
    trash_dir_name,
    uncommitted_message,
    uncommitted_step_dirs,
)
from d9d.ckpt.checkpoint.retention import Retention
from d9d.ckpt.checkpoint.staging import HostStaging
from d9d.ckpt.checkpoint.state_dicts import live_state, quiet_local_dcp
from d9d.ckpt.checkpoint.storage import ChecksummingWriter
from d9d.ckpt.checkpoint.visibility import collect_files
from d9d.mesh import get_logger

__all__ = ["Committer"]

_log = get_logger("d9d.ckpt")


@dataclass(frozen=True)
class _Save:
    """One save the ranks agreed to write: where it is written and what its commit records."""

    step: int
    tmp: Path
    has_optimizer: bool
    trainable_only: bool
    metrics: dict[str, float] | None
    metrics_step: int | None


class Committer:
    """Writes the saves of one run and commits each once every rank wrote its part (collective).

    Args:
        group: the checkpoint code's own process group.
        run_dir: `<save_dir>/<run_name>`.
        save_dir: the absolute `save_dir`, named when it is not shared by all nodes.
        retention: prunes after each commit (on rank 0).
        staging: the host buffers of asynchronous saves.
        async_save: write and commit on a background thread; `wait` or `poll` for the result.
        mesh: the job's mesh config, recorded in each commit marker.
    """

    def __init__(
        self,
        group: CheckpointGroup,
        run_dir: Path,
        save_dir: Path,
        retention: Retention,
        staging: HostStaging,
        *,
        async_save: bool,
        mesh: dict[str, Any] | None,
    ) -> None:
        self._group = group
        self._run_dir = run_dir
        self._save_dir = save_dir
        self._retention = retention
        self._staging = staging
        self._async = async_save
        self._mesh = mesh
        # Every rank must name the temporary directory of a save alike: one id per manager + a counter.
        self._manager_id: str = group.broadcast(uuid.uuid4().hex[:8])
        self._seq = 0
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[CheckpointInfo] | None = None

    @property
    def pending(self) -> bool:
        """True while an asynchronous save has not been waited for."""
        return self._pending is not None

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        extra_state: Mapping[str, Any] | None,
        rank_state: Mapping[str, Any] | None,
        trainable_only: bool,
        metrics: Mapping[str, float] | None,
        metrics_step: int | None,
    ) -> CheckpointInfo | None:
        """`CheckpointManager.save`: the committed checkpoint, or None while it writes asynchronously."""
        self.wait()
        tmp = self._next_temp_dir(step)
        error: Failure | None = None
        state: dict[str, Any] = {}
        own_files: dict[str, WrittenFile] = {}
        try:
            step_dir_name(step)  # validates the step
            state = live_state(model, optimizer, trainable_only=trainable_only)
            own_files = self._write_own_files(tmp, extra_state, rank_state)
        except Exception as exc:
            error = Failure.of(exc)
        self._agree_to_write(step, tmp, error)
        save = _Save(
            step=step,
            tmp=tmp,
            has_optimizer=optimizer is not None,
            trainable_only=trainable_only,
            metrics={str(k): float(v) for k, v in metrics.items()} if metrics is not None else None,
            metrics_step=metrics_step,
        )
        writer = ChecksummingWriter(tmp)
        if self._async:
            self._start_async(save, state, writer, own_files)
            return None
        write_error = self._write(state, writer)
        return self._finish(save, write_error, {**own_files, **writer.written})

    def wait(self) -> CheckpointInfo | None:
        """`CheckpointManager.wait`: the pending save's checkpoint once committed and pruning is done."""
        pending, self._pending = self._pending, None
        try:
            return pending.result() if pending is not None else None
        finally:
            self._retention.join()

    def poll(self) -> CheckpointInfo | None:
        """`CheckpointManager.poll`: the pending save's checkpoint if committed by now, else None."""
        pending = self._pending
        if pending is None or not pending.done():
            return None
        return self.wait()

    def close(self) -> None:
        """Release the background thread (after `wait`)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ before the collective write

    def _next_temp_dir(self, step: int) -> Path:
        save_id = f"{self._manager_id}{self._seq:04x}"
        self._seq += 1
        return self._run_dir / temp_dir_name(step, save_id)

    def _write_own_files(
        self, tmp: Path, extra_state: Mapping[str, Any] | None, rank_state: Mapping[str, Any] | None
    ) -> dict[str, WrittenFile]:
        """Write this rank's msgpack files (rank 0 the extra state); each with its size and checksum."""
        extra = encode_state(extra_state or {}, "extra_state")
        own = encode_state(rank_state, "rank_state") if rank_state is not None else None
        tmp.mkdir(parents=True, exist_ok=True)
        written: dict[str, WrittenFile] = {}
        for name, data in ((EXTRA_FILE, extra if self._group.rank == 0 else None),
                           (rank_file_name(self._group.rank), own)):  # fmt: skip
            if data is not None:
                write_durable(tmp / name, data)
                written[name] = (len(data), checksum_bytes(data))
        return written

    def _agree_to_write(self, step: int, tmp: Path, error: Failure | None) -> None:
        """Raise on every rank when any rank failed to prepare, or the ranks save different steps."""
        # Agree before the collective write: a rank that failed alone would leave the others hanging.
        votes = self._group.all_gather((step, error))
        if any(e is not None for _, e in votes):
            self._discard(tmp)
        self._raise_first_error(votes, f"saving checkpoint step {step}", step)
        if len({s for s, _ in votes}) != 1:
            raise CheckpointError(f"ranks disagree on the step to save: {[s for s, _ in votes]}")

    # ------------------------------------------------------------------ the collective write

    def _write(self, state: dict[str, Any], writer: ChecksummingWriter) -> Failure | None:
        """Write the state with DCP (collective); this rank's failure, if any."""
        try:
            with quiet_local_dcp():
                dcp.save(
                    state,
                    storage_writer=writer,
                    process_group=self._group.group,
                    no_dist=self._group.is_local,
                )
        except (Exception, CheckpointException) as exc:  # DCP's own error is a BaseException
            return Failure.of(exc)
        return None

    def _start_async(
        self,
        save: _Save,
        state: dict[str, Any],
        writer: ChecksummingWriter,
        own_files: dict[str, WrittenFile],
    ) -> None:
        """Copy the state to host memory and leave its write and commit to the background thread."""
        with quiet_local_dcp():
            upload = dcp.async_save(
                state,
                storage_writer=writer,
                process_group=self._group.group,
                async_stager=self._staging.stager(state),
                no_dist=self._group.is_local,
            )
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="d9d-ckpt-commit")
        self._pending = self._executor.submit(self._finish_async, save, upload, writer, own_files)

    def _finish_async(
        self, save: _Save, upload: Any, writer: ChecksummingWriter, own_files: dict[str, WrittenFile]
    ) -> CheckpointInfo:
        try:
            upload.result()
            write_error = None
        except (Exception, CheckpointException) as exc:
            write_error = Failure.of(exc)
        return self._finish(save, write_error, {**own_files, **writer.written})

    # ------------------------------------------------------------------ after the collective write

    def _finish(
        self, save: _Save, write_error: Failure | None, written: dict[str, WrittenFile]
    ) -> CheckpointInfo:
        """Commit once every rank wrote its part; runs on all ranks (in the background when async).

        `written`: the files this rank wrote, with their sizes and checksums.
        """
        step, tmp = save.step, save.tmp
        votes = self._group.all_gather((step, write_error, written))
        if any(error is not None for _, error, _ in votes):
            self._discard(tmp)
        self._raise_first_error([(s, e) for s, e, _ in votes], f"writing checkpoint step {step}", step)
        result: tuple[CheckpointInfo | None, Failure | None] = (None, None)
        if self._group.rank == 0:
            try:
                pause_for_test(PAUSE_BEFORE_COMMIT_ENV, step)
                result = (self._commit(save, [w for _, _, w in votes]), None)
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

    def _commit(self, save: _Save, reported: list[dict[str, WrittenFile]]) -> CheckpointInfo:
        """Rank 0: record, fsync and rename the save into place, fsync the run directory, then prune."""
        written = collect_files(save.tmp, reported, self._save_dir)  # every rank's files visible here?
        record = self._record(save, written)
        write_durable(save.tmp / COMMIT_FILE, msgspec.json.format(msgspec.json.encode(record)))
        fsync_dir(save.tmp)
        final = self._run_dir / step_dir_name(save.step)
        if final in uncommitted_step_dirs(self._run_dir):
            raise CheckpointError(uncommitted_message(self._run_dir, [final]))
        # Saving a step again replaces it (e.g. after resuming from an older checkpoint): the old one
        # moves aside first, since a rename cannot replace a non-empty directory.
        replaced = None
        if final.exists() or final.is_symlink():
            replaced = self._run_dir / trash_dir_name(save.step, uuid.uuid4().hex[:12])
            os.rename(final, replaced)
        os.rename(save.tmp, final)
        fsync_dir(self._run_dir)
        _log.info("checkpoint committed", step=save.step, path=str(final))
        # Only now that the new checkpoint is durable may older ones go, off the training path.
        self._retention.after_commit(keep=final, step=save.step, replaced=replaced)
        return CheckpointInfo(step=save.step, path=final, meta=record)

    def _record(self, save: _Save, written: dict[str, WrittenFile]) -> CheckpointMeta:
        """The commit marker of `save`: what it holds, and every rank's files with sizes and checksums."""
        return CheckpointMeta(
            step=save.step,
            created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            d9d_ckpt_version=_package_version(),
            torch_version=str(torch.__version__),
            world_size=self._group.world_size,
            mesh=self._mesh,
            has_optimizer=save.has_optimizer,
            trainable_only=save.trainable_only,
            metrics=save.metrics,
            metrics_step=save.metrics_step,
            files={name: size for name, (size, _) in written.items()},
            checksums={name: checksum for name, (_, checksum) in written.items()},
        )

    # ------------------------------------------------------------------ a failed save

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


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.exists():
            remove(path)


def _package_version() -> str:
    try:
        return importlib.metadata.version("d9d-ckpt")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
