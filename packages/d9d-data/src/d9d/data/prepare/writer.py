"""Writes a prepared folder so that a killed prepare can continue: a shard per source, each written
under a temporary name and renamed when complete, a record per finished shard in `STATE_DIR`, and the
index last. A prepare started again keeps the shards whose source and settings did not change."""

import errno
import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from d9d.data.errors import DatasetError
from d9d.data.prepare.index import INDEX_FILE, STATE_DIR, PreparedIndex, PreparedShard, read_index
from d9d.data.prepare.sources import source_bytes, source_mtime_ns

__all__ = [
    "ShardJob",
    "commit_index",
    "existing_index",
    "plan_jobs",
    "record_shard",
    "remove_temporaries",
    "resume",
    "write_atomic",
]


@dataclass(frozen=True)
class ShardJob:
    """One source to tokenize into one shard file, and the source's identity when it was planned."""

    index: int
    source: str
    source_bytes: int
    source_mtime_ns: int
    file: str
    text_key: str
    dtype: str

    @property
    def identity(self) -> tuple[str, int, int]:
        """The source as a finished shard must have read it (name, size, modification time)."""
        return (self.source, self.source_bytes, self.source_mtime_ns)


def plan_jobs(files: list[Path], text_key: str, dtype: str) -> list[ShardJob]:
    """A job per source file: shard i (`shard-<i>.bin`) from the i-th file."""
    return [
        ShardJob(
            i, str(path), source_bytes(path), source_mtime_ns(path), f"shard-{i:05d}.bin", text_key, dtype
        )
        for i, path in enumerate(files)
    ]


def existing_index(out: Path, jobs: list[ShardJob], settings: dict[str, Any]) -> PreparedIndex | None:
    """The folder's index when it is a finished prepare of exactly these jobs, None when there is none.

    Raises:
        DatasetError: it is a prepare of other sources or settings, or a shard is not the size its
            index says.
    """
    if not (out / INDEX_FILE).is_file():
        return None
    index = read_index(out)
    have = [_identity(shard) for shard in index.shards]
    want = [job.identity for job in jobs]
    mine = index.settings
    if have != want or mine != settings:
        changed = sorted(k for k in settings if mine.get(k) != settings[k])
        if changed:
            what = f"other settings ({', '.join(changed)})"
        elif [h[0] for h in have] != [w[0] for w in want]:
            what = f"other sources ({len(have)} of them)"
        else:
            edited = next(w[0] for h, w in zip(have, want, strict=True) if h != w)
            what = f"sources that changed since (e.g. {edited})"
        raise DatasetError(
            f"{out} already holds a prepared dataset of {what}; prepare into another --out folder, or "
            "delete that one"
        )
    for shard in index.shards:
        _check_shard_size(out, shard, index.dtype)
    return index


def resume(out: Path, jobs: list[ShardJob], settings: dict[str, Any]) -> dict[int, PreparedShard]:
    """Make `out` ready for a prepare (its state folder, no temporaries left) and return the shards an
    interrupted prepare finished that still match their job (same source and settings), by job index."""
    state = out / STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    remove_temporaries(out)
    done: dict[int, PreparedShard] = {}
    for job in jobs:
        record_path = state / f"{job.file}.json"
        if not record_path.is_file() or not (out / job.file).is_file():
            continue
        try:
            record = json.loads(record_path.read_bytes())
            keys = ("file", "source", "source_bytes", "documents", "tokens", "source_mtime_ns")
            shard = PreparedShard(**{k: record[k] for k in keys})
        except (ValueError, KeyError, TypeError):
            continue  # a record from another version: redo the shard
        same = all(record.get(k) == v for k, v in settings.items())
        whole = (out / job.file).stat().st_size == shard.tokens * np.dtype(job.dtype).itemsize
        if same and whole and _identity(shard) == job.identity:
            done[job.index] = shard
    return done


def record_shard(out: Path, job: ShardJob, shard: PreparedShard, settings: dict[str, Any]) -> None:
    """Record a finished shard, with the settings it was made with, so that a rerun keeps it."""
    record = {**settings, **msgspec.to_builtins(shard)}
    _write_durably(out / STATE_DIR / f"{job.file}.json", json.dumps(record).encode())


def commit_index(out: Path, index: PreparedIndex) -> None:
    """Write the index, which makes the folder a dataset, then drop the records of the unfinished prepare."""
    _write_durably(out / INDEX_FILE, msgspec.json.format(msgspec.json.encode(index)))
    shutil.rmtree(out / STATE_DIR, ignore_errors=True)


def remove_temporaries(out: Path) -> None:
    """Remove the shards a killed prepare left half-written."""
    for tmp in out.glob(".shard-*.tmp-*"):
        tmp.unlink(missing_ok=True)


def write_atomic(path: Path, chunks: Iterable[bytes | memoryview]) -> None:
    """Write `chunks` to `path` under a temporary name, fsync it and rename it into place, so `path`
    is whole or absent.

    Raises:
        DatasetError: the disk, the quota or the file size limit is full (other write errors as they are).
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as handle:
            for chunk in chunks:
                handle.write(chunk)  # not numpy's tofile: its short write has no errno
            handle.flush()
            os.fsync(handle.fileno())  # on disk before it is renamed into place
        tmp.replace(path)
    except OSError as exc:
        raise _no_room(exc, path) from None
    finally:
        tmp.unlink(missing_ok=True)


def _write_durably(path: Path, data: bytes) -> None:
    """`write_atomic`, and the rename made durable too."""
    write_atomic(path, (data,))
    _fsync_dir(path.parent)


def _identity(shard: PreparedShard) -> tuple[str, int, int]:
    """The source as the shard read it, to compare with `ShardJob.identity`."""
    return (shard.source, shard.source_bytes, shard.source_mtime_ns)


def _check_shard_size(out: Path, shard: PreparedShard, dtype: str) -> None:
    path = out / shard.file
    expected = shard.tokens * np.dtype(dtype).itemsize
    size = path.stat().st_size if path.is_file() else None
    if size != expected:
        found = "missing" if size is None else f"{size} bytes"
        raise DatasetError(
            f"{path} is {found}, the index says {expected} bytes ({shard.tokens} tokens); the folder is "
            "damaged: prepare it again into an empty folder"
        )


#: Write errors of a full disk, a full quota and a file size limit.
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _no_room(exc: OSError, path: Path) -> OSError | DatasetError:
    """A full disk (or quota, or file size limit) as one line; any other write error as it was."""
    if exc.errno not in _DISK_FULL:
        return exc
    return DatasetError(
        f"no room to write {path} ({os.strerror(exc.errno)}): free space under {path.parent} (or raise the "
        "quota or file size limit) and run the same command again; the shards finished so far are kept"
    )


def _fsync_dir(folder: Path) -> None:
    """Make the renames into `folder` durable (a crash may otherwise keep the new index, not the shards)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
