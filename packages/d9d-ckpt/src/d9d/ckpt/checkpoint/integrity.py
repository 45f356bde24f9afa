"""A checkpoint's integrity: the checksums written at commit, and every check before a load or on demand.

Checksums. Every rank checksums the files it wrote itself: its torch.distributed.checkpoint shards
(read back once the DCP writer closed them, on the writer's own thread, so an asynchronous save
computes them off the training path) and its msgpack files (from the bytes in memory). The committing
rank records them in the commit record, `CheckpointMeta.checksums`, as `crc32:<8 hex digits>`
(zlib's CRC-32: it detects every burst error up to 32 bits, so every flipped byte). Checkpoints
written before d9d recorded checksums have `checksums=None`: they load, and verification says they
have none.

Checks. A checkpoint is refused when a file recorded at commit is missing or has another size
(truncated or overwritten: `check_checkpoint_files`, the one size rule), when its DCP metadata cannot
be read, or when its keys, shapes and dtypes do not match the state the model and optimizer expect.
These run on the metadata and file sizes only, so a refused checkpoint leaves the model untouched.
With `verify`, every file is also read and compared with its checksum, which finds a flipped byte
that leaves the size alone; `verify_checkpoint` does that for one checkpoint on demand (what
`d9d checkpoints --verify` runs).

On a shared file system the checks must not multiply with the rank count: one rank runs
`inspect_checkpoint` (stats every file, reads the extra state and the DCP metadata once) and
broadcasts the `CheckpointReport`; every rank then checks its own live state against the metadata
in memory, and `KnownMetadataReader` (`storage.py`) hands the same metadata to the load instead of
every rank opening `.metadata` again. So the file-system metadata operations of a load stay
O(files), not O(ranks x files).

Nothing here imports torch until a load needs it (the DCP metadata, a live state's tensors), so
listing a run and `verify_checkpoint` read only the commit record and the files' bytes.
"""

import re
import threading
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from d9d.ckpt.checkpoint.errors import CheckpointError
from d9d.ckpt.checkpoint.extra import decode_state
from d9d.ckpt.checkpoint.layout import EXTRA_FILE, CheckpointInfo, recovery_hint

if TYPE_CHECKING:  # torch is imported where a load needs it: listing and verifying run without it
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "ALGORITHM",
    "METADATA_FILE",
    "BackgroundVerification",
    "CheckpointReport",
    "CheckpointVerification",
    "FileProblem",
    "FileProblemKind",
    "WrittenFile",
    "check_checkpoint_files",
    "check_checksums",
    "check_keys",
    "checksum_bytes",
    "checksum_file",
    "inspect_checkpoint",
    "problem_report",
    "read_dcp_metadata",
    "verifier_of",
    "verify_checkpoint",
]

#: The algorithm prefix of every recorded checksum.
ALGORITHM = "crc32"
#: What a rank reports of a file it wrote: (size in bytes, checksum).
WrittenFile = tuple[int, str]
#: How a recorded file fails its size check: gone, not stat-able, shorter or of another size.
FileProblemKind = Literal["missing", "unreadable", "truncated", "changed"]

_CHUNK = 8 << 20
#: The torch.distributed.checkpoint metadata file, written by DCP's coordinator in `finish`.
METADATA_FILE = ".metadata"
_MAX_LISTED_PROBLEMS = 20

# ------------------------------------------------------------------ checksums


def checksum_bytes(data: bytes | bytearray | memoryview) -> str:
    """The checksum of bytes in memory, as recorded in a commit record."""
    return f"{ALGORITHM}:{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def checksum_file(path: Path) -> str:
    """The checksum of a file, read in chunks (memory stays at one chunk)."""
    crc = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)  # releases the GIL on large chunks
    return f"{ALGORITHM}:{crc & 0xFFFFFFFF:08x}"


def check_checksums(path: Path, checksums: Mapping[str, str], names: set[str] | None = None) -> list[str]:
    """The files of `checksums` (or only `names`) whose content no longer matches, as problem lines."""
    problems = []
    label = path.name
    for name, expected in sorted(checksums.items()):
        if names is not None and name not in names:
            continue
        if not expected.startswith(f"{ALGORITHM}:"):
            problems.append(
                f"{label}/{name} has a checksum of an unknown kind ({expected}); cannot verify it"
            )
            continue
        try:
            actual = checksum_file(path / name)
        except OSError as exc:
            problems.append(f"{label}/{name} cannot be read ({exc})")
            continue
        if actual != expected:
            problems.append(f"{label}/{name} is damaged (checksum mismatch)")
    return problems


# ------------------------------------------------------------------ file sizes


@dataclass(frozen=True)
class FileProblem:
    """A file of a committed checkpoint that does not have the size its commit recorded.

    Attributes:
        name: the file, relative to the checkpoint directory.
        kind: what is wrong with it (`truncated`: shorter than recorded; `changed`: longer).
        recorded: its size in bytes when the checkpoint was committed.
        size: its size now (None when `missing` or `unreadable`).
        error: why it cannot be stat-ed (`unreadable` only).
    """

    name: str
    kind: FileProblemKind
    recorded: int
    size: int | None = None
    error: str | None = None

    def describe(self, checkpoint: str) -> str:
        """The problem as a line of the load error, the file named `<checkpoint>/<name>`."""
        label = f"{checkpoint}/{self.name}"
        if self.kind == "missing":
            return f"{label} is missing (the commit recorded {self.recorded} bytes)"
        if self.kind == "unreadable":
            return f"{label} cannot be read: {self.error}"
        return f"{label} is {self.kind}: {self.size} bytes, the commit recorded {self.recorded}"


def check_checkpoint_files(info: CheckpointInfo) -> list[FileProblem]:
    """Every file of a committed checkpoint whose size is not the one its commit recorded (stats only)."""
    problems = []
    for name, recorded in sorted(info.meta.files.items()):
        try:
            size = (info.path / name).stat().st_size
        except FileNotFoundError:
            problems.append(FileProblem(name, "missing", recorded))
            continue
        except OSError as exc:
            problems.append(FileProblem(name, "unreadable", recorded, error=str(exc)))
            continue
        if size != recorded:
            problems.append(FileProblem(name, "truncated" if size < recorded else "changed", recorded, size))
    return problems


def _file_problem_lines(path: Path, problems: list[FileProblem]) -> list[str]:
    """`problems` as lines of the load error, a damaged shard with the keys it holds (when readable)."""
    if not problems:
        return []
    metadata, _ = read_dcp_metadata(path)
    keys: dict[str, list[str]] = {}
    if metadata is not None and metadata.storage_data:
        for index, stored in metadata.storage_data.items():
            keys.setdefault(stored.relative_path, []).append(index.fqn)
    lines = []
    for problem in problems:
        line = problem.describe(path.name)
        held = sorted(set(keys.get(problem.name, [])))
        if held:
            more = f" and {len(held) - 3} more" if len(held) > 3 else ""
            line += f"; it holds keys {', '.join(held[:3])}{more}"
        lines.append(line)
    return lines


# ------------------------------------------------------------------ before a load


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
    metadata: "Metadata | None" = None
    metadata_error: str | None = None
    verified: bool | None = None


def inspect_checkpoint(
    info: CheckpointInfo, *, with_metadata: bool, verify: bool = False
) -> CheckpointReport:
    """Check the files of a checkpoint, read its extra state and (`with_metadata`) its DCP metadata.

    With `verify`, every file is read and compared with its recorded checksum first.
    Never raises: whatever goes wrong becomes a problem of the report (the other ranks wait for it).
    """
    path, checksums = info.path, info.meta.checksums
    verified = (checksums is not None) if verify else None
    try:
        problems = _file_problem_lines(path, check_checkpoint_files(info))
        if not problems and verify and checksums is not None:
            problems = check_checksums(path, checksums)
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


def problem_report(
    path: Path, problems: list[str], hint: str | None = None, *, damaged: bool = True, loaded: bool = False
) -> str:
    """The load error of checkpoint `path`: its problems, and for a damaged one how to recover.

    `hint` is `recovery_hint(path)` when known (computed here otherwise, which lists the run).
    `loaded`: the problems were found while the checkpoint was being read into the model (its
    checksums are verified during the load), so the model's state is undefined.
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
    outcome = (
        "the model's state is undefined (found while loading it): do not use it"
        if loaded
        else "nothing was loaded"
    )
    return f"checkpoint {path} cannot be loaded ({count}); {outcome}:\n" + "\n".join(lines)


def verifier_of(name: str, world_size: int) -> int:
    """The rank that verifies file `name` of a checkpoint while it loads: the rank that wrote a rank's
    shards and rank file, modulo `world_size` (so a load on fewer ranks still verifies every file),
    rank 0 the rest."""
    match = _RANK_OWNED.fullmatch(name)
    return int(match.group(1) or match.group(2)) % world_size if match else 0


#: `__<rank>_<n>.distcp` (a DCP shard) and `rank-<rank>.msgpack` (a rank's own state).
_RANK_OWNED = re.compile(r"__(\d+)_\d+\.distcp|rank-(\d+)\.msgpack")


class BackgroundVerification:
    """This rank's share of a checkpoint's checksums, computed on a thread while the load reads the
    same files (zlib releases the GIL; the second reader of a file finds it in the page cache), so
    verifying costs little more wall time than the load alone. `result()` joins it: problem lines."""

    def __init__(self, info: CheckpointInfo, rank: int, world_size: int) -> None:
        checksums = info.meta.checksums or {}
        names = {n for n in checksums if verifier_of(n, world_size) == rank}
        self._problems: list[str] = []
        self._thread = threading.Thread(
            target=self._run, args=(info.path, checksums, names), name="d9d-ckpt-verify", daemon=True
        )
        self._thread.start()

    def _run(self, path: Path, checksums: Mapping[str, str], names: set[str]) -> None:
        try:
            self._problems = check_checksums(path, checksums, names)
        except Exception as exc:  # reported like a damaged file: the load must not pass unverified
            self._problems = [f"{path.name} could not be verified ({type(exc).__name__}: {exc})"]

    def result(self) -> list[str]:
        self._thread.join()
        return list(self._problems)


def read_dcp_metadata(path: Path) -> tuple["Metadata | None", str | None]:
    """The torch.distributed.checkpoint metadata of a checkpoint, or the reason it cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(path)).read_metadata(), None
    except Exception as exc:  # a corrupt pickle raises anything
        return None, f"the torch.distributed.checkpoint metadata cannot be read ({type(exc).__name__}: {exc})"


#: Keys whose floating-point dtype may differ from the checkpoint's: the optimizer's per-parameter
#: states, which the load casts (float32 states saved, bfloat16 states loaded, or the other way).
_CASTABLE_PREFIX = "optimizer.state."


def check_keys(live: dict[str, Any], metadata: "Metadata") -> list[str]:
    """Problems of one rank's flattened live state against the checkpoint: missing keys, shapes, dtypes.

    `live` is flattened the way torch.distributed.checkpoint flattens (`model.<fqn>`,
    `optimizer.state.<fqn>.<name>`, ...). Keys the checkpoint holds but no rank asks for are found by
    the caller, across ranks. A dtype must match, except one floating-point dtype for another under
    `_CASTABLE_PREFIX` (the load casts those; a model weight of another dtype is refused).
    """
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

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
            elif entry.properties.dtype != value.dtype and not _castable(
                key, entry.properties.dtype, value.dtype
            ):
                problems.append(
                    f"dtype mismatch at key {key}: the checkpoint holds {entry.properties.dtype}, "
                    f"the model expects {value.dtype}"
                )
        elif not isinstance(entry, BytesStorageMetadata):
            problems.append(f"key {key}: the model expects an object, the checkpoint holds a tensor")
    return problems


def _castable(key: str, stored: Any, live: Any) -> bool:
    return key.startswith(_CASTABLE_PREFIX) and stored.is_floating_point and live.is_floating_point


# ------------------------------------------------------------------ on demand


@dataclass(frozen=True)
class CheckpointVerification:
    """The outcome of verifying one checkpoint.

    Attributes:
        problems: one line per damaged file (`save-4/<file> is damaged (checksum mismatch)`, ...).
        has_checksums: False for a checkpoint written before d9d recorded checksums: only the file
            sizes were checked.
        recovery: how to get past the damage (`move save-4 aside to resume from save-2`), None if ok.
    """

    info: CheckpointInfo
    problems: list[str]
    has_checksums: bool
    recovery: str | None

    @property
    def ok(self) -> bool:
        """True when no damage was found."""
        return not self.problems


def verify_checkpoint(info: CheckpointInfo) -> CheckpointVerification:
    """Check every file of a committed checkpoint against its recorded size and checksum (reads them all)."""
    checksums = info.meta.checksums
    resized = check_checkpoint_files(info)
    problems = _file_problem_lines(info.path, resized)
    if checksums is not None:  # a file of another size is reported once, by its size
        problems += check_checksums(info.path, checksums, set(info.meta.files) - {p.name for p in resized})
    return CheckpointVerification(
        info=info,
        problems=problems,
        has_checksums=checksums is not None,
        recovery=recovery_hint(info.path) if problems else None,
    )
