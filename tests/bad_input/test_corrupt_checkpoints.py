"""Damaged checkpoints and checkpoints of another model, resumed by `d9d train` (and `python train.py`).

A tiny run trains to a committed `save-2`; each case copies it, damages the copy (a truncated shard, a
missing or garbled file) or resumes it with a config whose model differs (other shapes, other keys).
The job must exit non-zero with one line naming the checkpoint and the problem, print no traceback,
and leave the whole job directory as it was: the damaged checkpoint neither loaded nor deleted, no
new checkpoint, no metrics, no log file (only the run lock file may appear, see RUN_LOCK).
"""

import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _corpus import (
    Case,
    clean_env,
    command,
    copy_tree,
    describe,
    judge,
    run_concurrently,
    run_driver,
    snapshot,
    write_case,
)

#: The pristine run: 2 steps, committed as save-2. Cases resume it towards 4 steps, without a log
#: file (the job starts before it meets the checkpoint, and a log file is a write).
TRAIN = ["trainer.schedule.total_steps=2"]
RESUME = ["trainer.schedule.total_steps=4", "trainer.logging.log_dir=null"]
#: The run lock (`d9d.trainer.LOCK_FILE`): every job takes it before it resumes and writes its pid
#: into it; the file means nothing once the process is gone (the kernel drops the flock), so it is
#: not compared.
RUN_LOCK = "runs/tiny/.lock"


def _largest(checkpoint: Path, pattern: str) -> Path:
    return max(checkpoint.glob(pattern), key=lambda p: p.stat().st_size)


def _truncate_shard(checkpoint: Path) -> str:
    shard = _largest(checkpoint, "*.distcp")
    os.truncate(shard, shard.stat().st_size // 2)
    return f"{shard.name} is truncated"


def _remove(name: str, problem: str) -> Callable[[Path], str]:
    def damage(checkpoint: Path) -> str:
        (checkpoint / name).unlink()
        return problem

    return damage


def _garble(name: str, problem: str) -> Callable[[Path], str]:
    def damage(checkpoint: Path) -> str:
        target = checkpoint / name
        target.write_bytes(b"\xc1" * target.stat().st_size)  # same size: only reading it tells
        return problem

    return damage


def _flip_byte(checkpoint: Path) -> str:
    shard = _largest(checkpoint, "*.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10  # the size stays: only the checksums (verify_on_load, the default) tell
    shard.write_bytes(bytes(data))
    return f"{shard.name} is damaged (checksum mismatch)"


def _unchanged(checkpoint: Path) -> str:
    return "cannot be loaded"


@dataclass(frozen=True)
class CheckpointCase:
    """A damage done to the copy of save-2 (returns a fragment the error must hold), and extra --set."""

    name: str
    damage: Callable[[Path], str]
    sets: list[str] = field(default_factory=list)
    expect: list[str] = field(default_factory=list)
    xfail: dict[str, str] = field(default_factory=dict)
    separate: bool = False


CASES = [
    CheckpointCase("truncated-shard", _truncate_shard, separate=True),
    CheckpointCase("flipped-byte-in-shard", _flip_byte),
    CheckpointCase("missing-dcp-metadata", _remove(".metadata", ".metadata is missing")),
    CheckpointCase(
        "garbled-dcp-metadata", _garble(".metadata", "torch.distributed.checkpoint metadata cannot be read")
    ),
    CheckpointCase("missing-extra-state", _remove("extra.msgpack", "extra.msgpack is missing")),
    CheckpointCase("garbled-extra-state", _garble("extra.msgpack", "extra.msgpack is corrupt")),
    CheckpointCase(
        "missing-commit-marker",
        _remove("commit.json", "commit.json"),
    ),
    CheckpointCase(
        "foreign-model-shapes",
        _unchanged,
        sets=["model.hidden_size=48"],
        expect=["shape mismatch at key model.model.embed_tokens.weight", "nothing was loaded"],
    ),
    CheckpointCase(
        "foreign-model-more-layers",
        _unchanged,
        sets=["model.num_layers=3"],
        expect=["missing key model.model.layers.2.", "nothing was loaded"],
    ),
    CheckpointCase(
        "foreign-model-fewer-layers",
        _unchanged,
        sets=["model.num_layers=1"],
        expect=["unexpected key model.model.layers.1.", "nothing was loaded"],
    ),
]
ENTRIES = ("cli", "script")


def _params(*, separate: bool = False) -> list[Any]:
    params = []
    for case in CASES:
        for entry in ("cli",) if separate else ENTRIES:
            if separate and not case.separate:
                continue
            reason = case.xfail.get(entry)
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            params.append(pytest.param(case, entry, id=f"{case.name}-{entry}", marks=marks))
    return params


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job directory (config + runs/tiny/save-2) of the tiny job trained for 2 steps."""
    directory = tmp_path_factory.mktemp("pristine")
    argv = write_case(Case(name="pristine", expect=[], sets=TRAIN), directory)
    done = run_concurrently({"train": (command("cli", argv), directory, clean_env())})["train"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert (directory / "runs" / "tiny" / "save-2" / "commit.json").is_file()
    shutil.rmtree(directory / "logs", ignore_errors=True)
    return directory


def _prepare(pristine: Path, case: CheckpointCase, directory: Path) -> tuple[list[str], list[str]]:
    copy_tree(pristine, directory)
    fragment = case.damage(directory / "runs" / "tiny" / "save-2")
    argv = ["config.yaml", *[arg for item in [*RESUME, *case.sets] for arg in ("--set", item)]]
    return argv, ["runs/tiny/save-2", fragment, *case.expect]


@pytest.fixture(scope="module")
def resumed(pristine: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every case through both entry points in one driver process, plus the `separate` ones alone."""
    root = tmp_path_factory.mktemp("bad-checkpoints")
    manifest, jobs, prepared = [], {}, {}
    for case in CASES:
        for entry in ENTRIES:
            key = f"{case.name}-{entry}"
            argv, expect = _prepare(pristine, case, root / key)
            prepared[key] = (expect, snapshot(root / key))
            manifest.append({"id": key, "entry": entry, "cwd": str(root / key), "argv": argv})
        if case.separate:
            key = f"{case.name}-separate"
            argv, expect = _prepare(pristine, case, root / key)
            prepared[key] = (expect, snapshot(root / key))
            jobs[key] = (command("cli", argv), root / key, clean_env())
    results = run_driver(manifest, root)
    for key, proc in run_concurrently(jobs).items():
        results[key] = {"code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
    return {
        key: {**results[key], "expect": expect, "before": before, "after": snapshot(root / key)}
        for key, (expect, before) in prepared.items()
    }


def _check(outcome: dict[str, Any]) -> None:
    before, after = (
        {k: v for k, v in outcome[side].items() if k != RUN_LOCK} for side in ("before", "after")
    )
    problems = judge(outcome["code"], outcome["stderr"], outcome["expect"], before, after)
    assert not problems, f"{problems}\n{describe({k: outcome[k] for k in ('code', 'stdout', 'stderr')})}"


@pytest.mark.parametrize(("case", "entry"), _params())
def test_damaged_checkpoint_is_refused_and_left_as_it_was(resumed, case, entry):
    _check(resumed[f"{case.name}-{entry}"])


@pytest.mark.parametrize(("case", "entry"), _params(separate=True))
def test_damaged_checkpoint_refused_by_a_process_of_its_own(resumed, case, entry):
    _check(resumed[f"{case.name}-separate"])
