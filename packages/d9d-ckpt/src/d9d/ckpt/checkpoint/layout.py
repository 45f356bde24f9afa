"""Where checkpoints live on disk and how a committed one is told apart from an unfinished one.

A run directory `<save_dir>/<run_name>/` holds committed checkpoints `save-<step>/` and, while a save
runs (or after one crashed), temporary directories `.save-<step>.tmp-<id>/`; a deletion renames a
checkpoint to `.trash-save-<step>-<id>/` first. This module is the one owner of those names
(`classify_run_entry` tells them apart). A directory counts as a checkpoint only when its name is
`save-<step>` *and* it holds a readable commit marker whose step matches: the marker is written
last, just before the atomic rename.
"""

import enum
import os
import re
from dataclasses import dataclass
from pathlib import Path

import msgspec

from d9d.ckpt.checkpoint.errors import CheckpointError

__all__ = [
    "COMMIT_FILE",
    "EXTRA_FILE",
    "CheckpointInfo",
    "CheckpointMeta",
    "RunEntryKind",
    "classify_run_entry",
    "list_checkpoints",
    "parse_step_dir",
    "rank_file_name",
    "read_checkpoint_info",
    "read_meta",
    "recovery_hint",
    "stale_dirs",
    "step_dir_name",
    "temp_dir_name",
    "trash_dir_name",
    "uncommitted_message",
    "uncommitted_step_dirs",
]

#: Name of the commit marker inside a checkpoint directory (JSON, see `CheckpointMeta`).
COMMIT_FILE = "commit.json"
#: The caller's extra state inside a checkpoint directory (msgpack, written by rank 0).
EXTRA_FILE = "extra.msgpack"
#: Format version written into every commit marker. 2: the optimizer state is flattened per parameter
#: name (each parameter's state and hyperparameters under its own key), so it loads on another
#: pipeline degree or schedule; 1: torch's nested optimizer state dict (still read).
FORMAT_VERSION = 2

_STEP_DIR = re.compile(r"save-(\d+)")
_TEMP_DIR = re.compile(r"\.save-\d+\.tmp-[0-9a-f]+")  # `temp_dir_name`: the id is hex
_TRASH_DIR = re.compile(r"\.trash-save-\d+-[0-9a-f]+")  # `trash_dir_name`


class RunEntryKind(enum.Enum):
    """What an entry of a run directory is, by its name alone (`classify_run_entry`)."""

    #: `save-<step>`: a checkpoint, committed only if it holds a valid commit record.
    CHECKPOINT = "checkpoint"
    #: `.save-<step>.tmp-<id>`: a save in progress, or the leftover of one that did not finish.
    UNFINISHED_SAVE = "unfinished save"
    #: `.trash-save-<step>-<id>`: a checkpoint being deleted, or the leftover of an interrupted deletion.
    INTERRUPTED_DELETION = "interrupted deletion"
    #: Anything else (metrics, logs, ...): not d9d-ckpt's.
    OTHER = "other"


_LEFTOVERS = (RunEntryKind.UNFINISHED_SAVE, RunEntryKind.INTERRUPTED_DELETION)


class CheckpointMeta(msgspec.Struct, frozen=True, kw_only=True):
    """What the commit marker of a checkpoint records about how and when it was written.

    Attributes:
        files: every file of the checkpoint (path relative to its directory) and its size in bytes,
            listed at commit time; loading refuses a checkpoint whose files do not match.
        mesh: the mesh degrees of the job that wrote it (`MeshConfig` fields), None if unknown.
        checksums: every file's checksum (`crc32:<hex>`, see `integrity.py`), computed by the rank
            that wrote it; None in checkpoints written before d9d recorded checksums.
        trainable_only: the model's frozen parameters were left out (`save(trainable_only=True)`).
        metrics: the caller's numbers at save time (`save(metrics=...)`, e.g. the trainer's last
            `eval_loss`), read by `keep_best` retention and `d9d checkpoints` without loading
            anything else; None when none were given.
        metrics_step: the step those numbers were measured at (an eval may be older than the save).
    """

    step: int
    created_at: str
    d9d_ckpt_version: str
    torch_version: str
    world_size: int
    mesh: dict[str, int] | None
    has_optimizer: bool
    files: dict[str, int]
    format: int = FORMAT_VERSION
    checksums: dict[str, str] | None = None
    trainable_only: bool = False
    metrics: dict[str, float] | None = None
    metrics_step: int | None = None


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint: its step, its directory and its commit record."""

    step: int
    path: Path
    meta: CheckpointMeta


def step_dir_name(step: int) -> str:
    """Directory name of the committed checkpoint of `step`."""
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, got {step}")
    return f"save-{step}"


def parse_step_dir(name: str) -> int | None:
    """The step of a `save-<step>` directory name, or None for any other name (`RunEntryKind.CHECKPOINT`)."""
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def classify_run_entry(name: str) -> RunEntryKind:
    """What the entry `name` of a run directory is, by the names d9d-ckpt gives its directories."""
    if parse_step_dir(name) is not None:
        return RunEntryKind.CHECKPOINT
    if _TEMP_DIR.fullmatch(name):
        return RunEntryKind.UNFINISHED_SAVE
    if _TRASH_DIR.fullmatch(name):
        return RunEntryKind.INTERRUPTED_DELETION
    return RunEntryKind.OTHER


def rank_file_name(rank: int) -> str:
    """File holding the per-rank state of `rank` inside a checkpoint."""
    return f"rank-{rank:05d}.msgpack"


def temp_dir_name(step: int, save_id: str) -> str:
    """Directory name a save of `step` writes into before it is committed."""
    return f".save-{step}.tmp-{save_id}"


def trash_dir_name(step: int, save_id: str) -> str:
    """Name a checkpoint is renamed to (atomically) before it is deleted."""
    return f".trash-save-{step}-{save_id}"


def read_meta(directory: Path) -> CheckpointMeta | None:
    """The commit record of a checkpoint directory, or None when it has none or it is unreadable."""
    try:
        data = (directory / COMMIT_FILE).read_bytes()
        return msgspec.json.decode(data, type=CheckpointMeta)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def list_checkpoints(run_dir: Path) -> list[CheckpointInfo]:
    """Every committed checkpoint of a run directory, oldest step first (empty if there is none)."""
    if not run_dir.is_dir():
        return []
    found: list[CheckpointInfo] = []
    for entry in run_dir.iterdir():
        step = parse_step_dir(entry.name)
        if step is None or entry.is_symlink() or not entry.is_dir():
            continue
        meta = read_meta(entry)
        if meta is None or meta.step != step:
            continue
        found.append(CheckpointInfo(step=step, path=entry, meta=meta))
    return sorted(found, key=lambda info: info.step)


def uncommitted_step_dirs(run_dir: Path) -> list[Path]:
    """`save-<step>` directories without a valid commit record: damaged, or not written by d9d.

    d9d never produces one (a save is renamed to `save-<step>` only after its commit record is
    written), so such a directory is never loaded, never replaced and never deleted: it is reported.
    """
    if not run_dir.is_dir():
        return []
    damaged = []
    for entry in run_dir.iterdir():
        step = parse_step_dir(entry.name)
        if step is None:
            continue
        meta = read_meta(entry) if entry.is_dir() and not entry.is_symlink() else None
        if meta is None or meta.step != step:
            damaged.append(entry)
    return sorted(damaged, key=lambda path: parse_step_dir(path.name) or 0)


def stale_dirs(run_dir: Path) -> list[Path]:
    """Leftover temporary and half-deleted directories of crashed saves (never loadable)."""
    if not run_dir.is_dir():
        return []
    return sorted(
        entry
        for entry in run_dir.iterdir()
        if classify_run_entry(entry.name) in _LEFTOVERS and entry.is_dir() and not entry.is_symlink()
    )


def read_checkpoint_info(path: str | os.PathLike[str]) -> CheckpointInfo:
    """The committed checkpoint at `path` (a `save-<step>` directory), e.g. of another run.

    Raises:
        CheckpointError: when `path` is not a committed checkpoint.
    """
    directory = Path(path)
    step = parse_step_dir(directory.name)
    meta = read_meta(directory) if step is not None else None
    if step is None or meta is None or meta.step != step:
        raise CheckpointError(
            f"{directory} is not a committed checkpoint (a `save-<step>` directory with a valid "
            f"{COMMIT_FILE}); it may be unfinished or from a crashed save"
        )
    return CheckpointInfo(step=step, path=directory, meta=meta)


def recovery_hint(checkpoint_dir: Path) -> str:
    """How to get past a damaged checkpoint: move it aside, and which checkpoint a resume then uses."""
    name = checkpoint_dir.name
    step = parse_step_dir(name)
    earlier = [info for info in list_checkpoints(checkpoint_dir.parent) if step is None or info.step < step]
    if earlier:
        return f"move {name} aside to resume from {earlier[-1].path.name}"
    return f"move {name} aside to start the run afresh (it has no earlier committed checkpoint)"


def uncommitted_message(run_dir: Path, damaged: list[Path]) -> str:
    """Why `uncommitted_step_dirs` of `run_dir` stop a save or a resume, and how to get past them."""
    names = ", ".join(str(path) for path in damaged)
    return (
        f"{names}: no valid {COMMIT_FILE}, so a damaged checkpoint or one not written by d9d; it is neither "
        f"loaded nor replaced. Move it out of {run_dir} ({recovery_hint(damaged[0])}), or use another "
        "trainer.run.name"
    )
