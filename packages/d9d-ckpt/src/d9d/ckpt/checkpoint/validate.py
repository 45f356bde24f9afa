"""Checks a checkpoint passes before anything is read into a live model.

A checkpoint is refused when a file recorded at commit is missing or has another size (truncated or
overwritten), when its torch.distributed.checkpoint metadata cannot be read, or when its keys, shapes
and dtypes do not match the state the model and optimizer expect. Every check runs on the metadata
and file sizes only, so a refused checkpoint leaves the model untouched. With `verify=True`, every
file is also read and compared with the checksum of its commit record (`checksum.py`), which finds
a flipped byte that leaves the size alone.

On a shared file system the checks must not multiply with the rank count: one rank runs
`inspect_checkpoint` (stats every file, reads the extra state and the DCP metadata once) and
broadcasts the `CheckpointReport`; every rank then checks its own live state against the metadata
in memory, and `KnownMetadataReader` hands the same metadata to the load instead of every rank
opening `.metadata` again. So the file-system metadata operations of a load stay O(files), not
O(ranks x files).
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)

from d9d.ckpt.checkpoint.checksum import check_checksums
from d9d.ckpt.checkpoint.errors import CheckpointError
from d9d.ckpt.checkpoint.extra import decode_state
from d9d.ckpt.checkpoint.layout import EXTRA_FILE, CheckpointMeta, recovery_hint

__all__ = [
    "CheckpointReport",
    "KnownMetadataReader",
    "check_files",
    "check_keys",
    "inspect_checkpoint",
    "problem_report",
    "read_dcp_metadata",
]

_MAX_LISTED_PROBLEMS = 20


@dataclass(frozen=True)
class CheckpointReport:
    """What one rank read about a checkpoint's files, for every rank (it pickles for a broadcast).

    Attributes:
        problems: damaged files and a corrupt extra state, as lines of the load error.
        extra_state: the decoded extra state (empty when there are problems).
        metadata: the torch.distributed.checkpoint metadata, when asked for and readable.
        metadata_error: why the metadata could not be read, when asked for.
        verified: with `verify`, whether the checksums were compared (False: the commit record has
            none); None when not asked.
    """

    problems: list[str]
    extra_state: dict[str, Any] = field(default_factory=dict)
    metadata: Metadata | None = None
    metadata_error: str | None = None
    verified: bool | None = None


def inspect_checkpoint(
    path: Path, meta: CheckpointMeta, *, with_metadata: bool, verify: bool = False
) -> CheckpointReport:
    """Check the files of a checkpoint, read its extra state and (`with_metadata`) its DCP metadata.

    With `verify`, every file is read and compared with its recorded checksum first.
    Never raises: whatever goes wrong becomes a problem of the report (the other ranks wait for it).
    """
    verified = (meta.checksums is not None) if verify else None
    try:
        problems = check_files(path, meta)
        if not problems and verify and meta.checksums is not None:
            problems = check_checksums(path, meta.checksums)
        if problems:
            return CheckpointReport(problems, verified=verified)
        try:
            extra = decode_state((path / EXTRA_FILE).read_bytes(), f"{path.name}/{EXTRA_FILE}")
        except (CheckpointError, OSError) as exc:
            return CheckpointReport([str(exc)], verified=verified)
        if not with_metadata:
            return CheckpointReport([], extra, verified=verified)
        metadata, error = read_dcp_metadata(path)
        return CheckpointReport([], extra, metadata, error, verified=verified)
    except Exception as exc:
        return CheckpointReport([f"the checkpoint cannot be inspected ({type(exc).__name__}: {exc})"])


class KnownMetadataReader(FileSystemReader):
    """A `FileSystemReader` of one checkpoint that returns metadata read before (and broadcast).

    `dcp.load` otherwise opens `.metadata` on every rank; with this reader only the shard files a
    rank needs are opened.
    """

    def __init__(self, path: str | Path, metadata: Metadata) -> None:
        super().__init__(str(path))
        self._known = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The known metadata (a per-rank metadata file, `rank=`, is still read from disk)."""
        if kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        metadata = self._known
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return metadata


def check_files(path: Path, meta: CheckpointMeta) -> list[str]:
    """Problems with the files of a checkpoint against the sizes recorded when it was committed.

    A damaged shard is reported with the keys it holds (from the DCP metadata, when readable).
    """
    damaged: dict[str, str] = {}
    for name, size in sorted(meta.files.items()):
        file = path / name
        label = f"{path.name}/{name}"
        try:
            actual = file.stat().st_size
        except FileNotFoundError:
            damaged[name] = f"{label} is missing (the commit recorded {size} bytes)"
            continue
        except OSError as exc:
            damaged[name] = f"{label} cannot be read: {exc}"
            continue
        if actual != size:
            kind = "truncated" if actual < size else "changed"
            damaged[name] = f"{label} is {kind}: {actual} bytes, the commit recorded {size}"
    if not damaged:
        return []
    metadata, _ = read_dcp_metadata(path)
    keys: dict[str, list[str]] = {}
    if metadata is not None and metadata.storage_data:
        for index, stored in metadata.storage_data.items():
            keys.setdefault(stored.relative_path, []).append(index.fqn)
    problems = []
    for name, problem in damaged.items():
        held = sorted(set(keys.get(name, [])))
        if held:
            more = f" and {len(held) - 3} more" if len(held) > 3 else ""
            problem += f"; it holds keys {', '.join(held[:3])}{more}"
        problems.append(problem)
    return problems


def problem_report(path: Path, problems: list[str], hint: str | None = None, *, damaged: bool = True) -> str:
    """The load error of checkpoint `path`: its problems, and for a damaged one how to recover.

    `hint` is `recovery_hint(path)` when known (computed here otherwise, which lists the run).
    """
    shown = problems[:_MAX_LISTED_PROBLEMS]
    more = len(problems) - len(shown)
    lines = [f"  - {p}" for p in shown] + ([f"  ... and {more} more"] if more else [])
    if damaged:
        hint = hint or recovery_hint(path)
        if len(lines) == 1:
            lines[0] += f"; {hint}"
        else:
            lines.append(f"  {hint}")
    count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}"
    return f"checkpoint {path} cannot be loaded ({count}); nothing was loaded:\n" + "\n".join(lines)


def read_dcp_metadata(path: Path) -> tuple[Metadata | None, str | None]:
    """The torch.distributed.checkpoint metadata of a checkpoint, or the reason it cannot be read."""
    try:
        return FileSystemReader(str(path)).read_metadata(), None
    except Exception as exc:  # a corrupt pickle raises anything
        return None, f"the torch.distributed.checkpoint metadata cannot be read ({type(exc).__name__}: {exc})"


def check_keys(live: dict[str, Any], metadata: Metadata) -> list[str]:
    """Problems of one rank's flattened live state against the checkpoint: missing keys, shapes, dtypes.

    `live` is flattened the way torch.distributed.checkpoint flattens (`model.<fqn>`,
    `optimizer.state.<fqn>.<name>`, ...). Keys the checkpoint holds but no rank asks for are found by
    the caller, across ranks.
    """
    stored = metadata.state_dict_metadata
    problems: list[str] = []
    for key, value in live.items():
        entry = stored.get(key)
        if entry is None:
            problems.append(f"missing key {key}: the model expects it, the checkpoint does not hold it")
            continue
        if isinstance(value, torch.Tensor):
            if not isinstance(entry, TensorStorageMetadata):
                problems.append(f"key {key}: the model expects a tensor, the checkpoint holds an object")
                continue
            shape = tuple(value.shape)  # a DTensor's shape is the global one
            if shape != tuple(entry.size):
                problems.append(
                    f"shape mismatch at key {key}: the checkpoint holds {list(entry.size)}, "
                    f"the model expects {list(shape)}"
                )
            elif entry.properties.dtype != value.dtype:
                problems.append(
                    f"dtype mismatch at key {key}: the checkpoint holds {entry.properties.dtype}, "
                    f"the model expects {value.dtype}"
                )
        elif not isinstance(entry, BytesStorageMetadata):
            problems.append(f"key {key}: the model expects an object, the checkpoint holds a tensor")
    return problems
