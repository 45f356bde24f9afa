"""The bad-config corpus (cases.yaml): each malformed job is refused by a real process in one line.

Every case runs through both entry points, `d9d train` and the quickstart's `python train.py`, in one
driver process (`_driver.py`: one torch import for dozens of cases). The cases marked `separate` run
again as processes of their own, and a world-size mismatch runs under a real 2-process torchrun.
Each must exit non-zero with exactly one `error:` line on stderr that names the key (or file) and the
fix, print no traceback, and write nothing: no run directory, no log file, no checkpoint.
"""

import re
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _corpus import (
    Case,
    base_config,
    clean_env,
    command,
    describe,
    judge,
    load_cases,
    run_concurrently,
    run_driver,
    snapshot,
    write_case,
)

from d9d.mesh.testing import run_torchrun

CASES = load_cases()


def _params(cases: list[Case], *, separate: bool = False) -> list[Any]:
    """(case, entry) pairs: every entry of every case, or each `separate` case through its entry."""
    params = []
    for case in cases:
        own = [case.separate] if case.separate else []
        for entry in own if separate else case.entries:
            marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
            params.append(pytest.param(case, entry, id=f"{case.name}-{entry}", marks=marks))
    return params


def _judge(case: Case, outcome: dict[str, Any]) -> list[str]:
    return judge(outcome["code"], outcome["stderr"], case.expect, outcome["before"], outcome["after"])


@pytest.fixture(scope="module")
def driven(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every case through both entry points in one driver process: result, and the case dir before/after."""
    root = tmp_path_factory.mktemp("bad-configs")
    base = base_config()
    manifest, before = [], {}
    for case in CASES:
        for entry in case.entries:
            key = f"{case.name}-{entry}"
            directory = root / key
            argv = write_case(case, directory, base)
            before[key] = snapshot(directory)
            pythonpath = [str(directory)] if case.importable else []
            manifest.append({"id": key, "entry": entry, "cwd": str(directory), "argv": argv,
                             "pythonpath": pythonpath})  # fmt: skip
    results = run_driver(manifest, root)
    return {key: {**results[key], "before": before[key], "after": snapshot(root / key)} for key in before}


@pytest.fixture(scope="module")
def separate(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The `separate` cases, each a process of its own (all started at once)."""
    root = tmp_path_factory.mktemp("bad-configs-separate")
    base = base_config()
    jobs, before = {}, {}
    for case in CASES:
        if case.separate is None:
            continue
        directory = root / case.name
        argv = write_case(case, directory, base)
        before[case.name] = snapshot(directory)
        env = clean_env([str(directory)] if case.importable else [])
        jobs[case.name] = (command(case.separate, argv), directory, env)
    done = run_concurrently(jobs)
    return {
        name: {"code": p.returncode, "stdout": p.stdout, "stderr": p.stderr, "before": before[name],
               "after": snapshot(root / name)}
        for name, p in done.items()
    }  # fmt: skip


def test_corpus_size():
    assert len(CASES) >= 30
    assert sum(1 for c in CASES if c.separate) >= 5


@pytest.mark.parametrize(("case", "entry"), _params(CASES))
def test_refused_in_one_line_writing_nothing(driven, case, entry):
    outcome = driven[f"{case.name}-{entry}"]
    problems = _judge(case, outcome)
    assert not problems, f"{problems}\n{describe(outcome)}"


@pytest.mark.parametrize(("case", "entry"), _params(CASES, separate=True))
def test_refused_by_a_process_of_its_own(separate, case, entry):
    outcome = separate[case.name]
    problems = _judge(case, outcome)
    assert not problems, f"{problems}\n{describe(outcome)}"


@pytest.mark.slow
def test_world_size_mismatch_under_torchrun_2(tmp_path):
    """2 processes for a mesh of 4: rank 0 says so in one line, rank 1 stays quiet, both exit non-zero."""
    case = Case(
        name="torchrun-world-size-mismatch",
        patch={"mesh": {"data_parallel_shard": 4}, "data": {"global_batch_size": 8, "microbatch_size": 2}},
        expect=["needs 4 processes", "torchrun started 2", "--nproc-per-node 4"],
    )
    directory = tmp_path / "job"
    argv = write_case(case, directory)
    before = snapshot(directory)
    logs = tmp_path / "torchrun-logs"  # outside the job directory: torchrun's own per-rank files
    result = run_torchrun(
        ["--log-dir", str(logs), "--redirects", "3", "-m", "d9d.cli", "train", *argv],
        nproc_per_node=2,
        cwd=directory,
        timeout=120,
    )
    assert result.returncode != 0
    stderr = {int(p.parent.name): p.read_text() for p in logs.rglob("stderr.log")}
    assert sorted(stderr) == [0, 1], sorted(logs.rglob("*"))
    problems = judge(2, stderr[0], case.expect, before, snapshot(directory))
    assert not problems, f"{problems}\nrank 0 stderr: {stderr[0]}\ntorchrun: {result.stderr[-3000:]}"
    assert stderr[1].strip() == "", f"rank 1 printed: {stderr[1]}"
    assert re.search(r"exitcode\s*:\s*2\b", result.stderr), result.stderr[-3000:]  # the reported error
