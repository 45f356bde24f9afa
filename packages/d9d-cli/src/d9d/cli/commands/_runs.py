"""Finding a run directory's checkpoints (committed, damaged, unfinished) from the CLI's side.

The names of a run directory and the size check of a checkpoint's files are d9d-ckpt's
(`d9d.ckpt.classify_run_entry`, `d9d.ckpt.check_checkpoint_files`), imported inside the functions:
this module imports no torch.
"""

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from d9d.cli.errors import CliError
from d9d.trainer.observe.metrics_file import METRICS_FILE  # torch-free, like this module

__all__ = ["RunScan", "Stray", "check_run_dir", "scan_run_dir"]

# How the `d9d checkpoints` status sums up the kinds of `d9d.ckpt.FileProblem` ("1 file missing").
_DAMAGE_WORDS = {"missing": "missing", "unreadable": "missing", "truncated": "resized", "changed": "resized"}


@dataclass(frozen=True)
class Stray:
    """A directory in a run that is not a loadable checkpoint, and why."""

    path: Path
    reason: str


@dataclass(frozen=True)
class RunScan:
    """What a run directory holds: committed checkpoints (oldest first) and everything else."""

    run_dir: Path
    committed: list[Any]  # d9d.ckpt.CheckpointInfo
    damaged: dict[int, str]  # step of a committed checkpoint → what is wrong with its files
    strays: list[Stray]


def check_run_dir(path: str | Path) -> Path:
    """`path` as a run directory (`save_dir/run.name`), or a `CliError` saying what it is instead."""
    run_dir = Path(path)
    if not run_dir.exists():
        near = _same_run_below(run_dir)
        hint = (
            f"; did you mean {near}? (a config's save_dir is relative to the config file)"
            if near is not None
            else "; pass a run directory (save_dir/run.name, e.g. runs/quickstart)"
        )
        raise CliError(f"{run_dir}: no such directory{hint}")
    if not run_dir.is_dir():
        raise CliError(f"{run_dir} is a file, not a run directory (save_dir/run.name, e.g. runs/quickstart)")
    names = {p.name for p in run_dir.iterdir()}
    if METRICS_FILE in names:  # a run (a checkpoint never holds it): `d9d metrics` stays torch-free
        return run_dir
    from d9d.ckpt import RunEntryKind, classify_run_entry

    checkpoint, unfinished = RunEntryKind.CHECKPOINT, RunEntryKind.UNFINISHED_SAVE
    if classify_run_entry(run_dir.name) is checkpoint:
        raise CliError(f"{run_dir} is one checkpoint; pass its run directory {run_dir.parent}")
    if not any(classify_run_entry(n) in (checkpoint, unfinished) for n in names):
        runs = sorted(
            p.name
            for p in run_dir.iterdir()
            if p.is_dir()
            and any(classify_run_entry(c.name) is checkpoint or c.name == METRICS_FILE for c in p.iterdir())
        )
        if runs:
            raise CliError(
                f"{run_dir} holds the runs {', '.join(runs)}; pass one of them, e.g. {run_dir / runs[0]}"
            )
    return run_dir


def _same_run_below(missing: Path, depth: int = 3) -> Path | None:
    """A directory ending in `missing` (relative) up to `depth` levels below the current one that holds
    a run's metrics file, e.g. examples/quickstart/runs/quickstart for runs/quickstart; None if none
    or several."""
    if missing.is_absolute():
        return None
    found = [
        candidate
        for level in range(1, depth + 1)
        for candidate in Path().glob("/".join(["*"] * level) + f"/{missing}")
        if (candidate / METRICS_FILE).is_file()
    ]
    return found[0] if len(found) == 1 else None


def scan_run_dir(run_dir: Path) -> RunScan:
    """Classify every checkpoint-like directory of `run_dir` (reads only the commit markers)."""
    from d9d.ckpt import (
        CheckpointError,
        RunEntryKind,
        check_checkpoint_files,
        classify_run_entry,
        read_checkpoint_info,
    )

    committed: list[Any] = []
    damaged: dict[int, str] = {}
    strays: list[Stray] = []
    for entry in sorted(run_dir.iterdir()):
        if not entry.is_dir():
            continue
        kind = classify_run_entry(entry.name)
        if kind is RunEntryKind.CHECKPOINT:
            try:
                info = read_checkpoint_info(entry)
            except CheckpointError:
                strays.append(Stray(entry, "incomplete: no valid commit.json, never loaded; delete it"))
                continue
            committed.append(info)
            problems = check_checkpoint_files(info)
            if problems:
                damaged[info.step] = _damage_summary([p.kind for p in problems])
        elif kind is RunEntryKind.UNFINISHED_SAVE:
            strays.append(Stray(entry, "leftover of a save that did not finish (a crash?); safe to delete"))
        elif kind is RunEntryKind.INTERRUPTED_DELETION:
            strays.append(Stray(entry, "leftover of an interrupted deletion; safe to delete"))
    committed.sort(key=lambda info: info.step)
    return RunScan(run_dir=run_dir, committed=committed, damaged=damaged, strays=strays)


def _damage_summary(kinds: list[str]) -> str:
    """The status of a checkpoint whose files failed d9d-ckpt's size check: `damaged: 1 file missing, ...`."""
    counts = Counter(_DAMAGE_WORDS[kind] for kind in kinds)
    parts = [
        f"{n} file{'s' if n > 1 else ''} {what}" for what in ("missing", "resized") if (n := counts[what])
    ]
    return "damaged: " + ", ".join(parts)


def best_policy(committed: list[Any]) -> Any:
    """The run's `d9d.ckpt.KeepBest`: its `trainer.checkpointing.keep_best` as the latest checkpoint's
    config holds it, else the best one by `eval_loss` (lower is better). Torch-free."""
    from d9d.ckpt import KeepBest
    from d9d.ckpt.checkpoint.extra import decode_state
    from d9d.ckpt.checkpoint.layout import EXTRA_FILE

    config: Any = {}
    if committed:
        try:
            path = committed[-1].path / EXTRA_FILE
            config = decode_state(path.read_bytes(), str(path)).get("config") or {}
        except Exception:  # an unreadable extra state: the default policy
            config = {}
    section = (
        config.get("trainer", {}).get("checkpointing", {}).get("keep_best")
        if isinstance(config, dict)
        else None
    )
    if not isinstance(section, dict):
        return KeepBest("eval_loss", "min", 1)
    try:
        return KeepBest(
            str(section.get("metric", "eval_loss")),
            str(section.get("mode", "min")),
            int(section.get("count", 1)),
        )
    except (TypeError, ValueError):
        return KeepBest("eval_loss", "min", 1)
