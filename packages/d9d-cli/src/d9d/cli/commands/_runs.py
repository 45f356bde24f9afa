"""Finding a run directory's checkpoints (committed, damaged, unfinished) from the CLI's side."""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from d9d.cli.errors import CliError

__all__ = ["METRICS_FILE", "RunScan", "Stray", "check_run_dir", "scan_run_dir"]

#: The trainer's per-step metrics file in a run directory (`d9d.trainer.METRICS_FILE`, kept torch-free).
METRICS_FILE = "metrics.jsonl"
_STEP_DIR = re.compile(r"save-\d+")
_TMP_DIR = re.compile(r"\.save-\d+\.tmp-.+")
_TRASH_DIR = re.compile(r"\.trash-save-\d+-.+")


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
        raise CliError(
            f"{run_dir}: no such directory; pass a run directory (save_dir/run.name, e.g. runs/quickstart)"
        )
    if not run_dir.is_dir():
        raise CliError(f"{run_dir} is a file, not a run directory (save_dir/run.name, e.g. runs/quickstart)")
    if _STEP_DIR.fullmatch(run_dir.name):
        raise CliError(f"{run_dir} is one checkpoint; pass its run directory {run_dir.parent}")
    names = {p.name for p in run_dir.iterdir()}
    looks_like_run = (
        any(_STEP_DIR.fullmatch(n) or _TMP_DIR.fullmatch(n) for n in names) or METRICS_FILE in names
    )
    if not looks_like_run:
        runs = sorted(
            p.name
            for p in run_dir.iterdir()
            if p.is_dir() and any(_STEP_DIR.fullmatch(c.name) or c.name == METRICS_FILE for c in p.iterdir())
        )
        if runs:
            raise CliError(
                f"{run_dir} holds the runs {', '.join(runs)}; pass one of them, e.g. {run_dir / runs[0]}"
            )
    return run_dir


def scan_run_dir(run_dir: Path) -> RunScan:
    """Classify every checkpoint-like directory of `run_dir` (reads only the commit markers)."""
    from d9d.ckpt import CheckpointError, read_checkpoint_info

    committed: list[Any] = []
    damaged: dict[int, str] = {}
    strays: list[Stray] = []
    for entry in sorted(run_dir.iterdir()):
        name = entry.name
        if not entry.is_dir():
            continue
        if _STEP_DIR.fullmatch(name):
            try:
                info = read_checkpoint_info(entry)
            except CheckpointError:
                strays.append(Stray(entry, "incomplete: no valid commit.json, never loaded; delete it"))
                continue
            committed.append(info)
            problem = _check_files(entry, info.meta.files)
            if problem:
                damaged[info.step] = problem
        elif _TMP_DIR.fullmatch(name):
            strays.append(Stray(entry, "leftover of a save that did not finish (a crash?); safe to delete"))
        elif _TRASH_DIR.fullmatch(name):
            strays.append(Stray(entry, "leftover of an interrupted deletion; safe to delete"))
    committed.sort(key=lambda info: info.step)
    return RunScan(run_dir=run_dir, committed=committed, damaged=damaged, strays=strays)


def _check_files(directory: Path, files: dict[str, int]) -> str | None:
    missing = resized = 0
    for rel, size in files.items():
        path = directory / rel
        if not path.is_file():
            missing += 1
        elif path.stat().st_size != size:
            resized += 1
    if not missing and not resized:
        return None
    parts = [
        f"{n} file{'s' if n > 1 else ''} {what}"
        for n, what in ((missing, "missing"), (resized, "resized"))
        if n
    ]
    return "damaged: " + ", ".join(parts)
