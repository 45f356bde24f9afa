"""Run lock, fault-injection variables and the watchdog's report, without processes."""

from pathlib import Path

import pytest

from d9d.mesh import DistributedContext
from d9d.trainer import TrainingError
from d9d.trainer.errors import RunLockedError
from d9d.trainer.faults.injection import FaultInjection
from d9d.trainer.faults.run_lock import LOCK_FILE, RunLock
from d9d.trainer.faults.watchdog import _message


def test_run_lock_is_exclusive_and_released(tmp_path: Path) -> None:
    context = DistributedContext.from_env(environ={})
    first = RunLock.acquire(tmp_path / "run", context)
    assert "pid" in (tmp_path / "run" / LOCK_FILE).read_text()
    with pytest.raises(RunLockedError, match=r"is in use by another job \(pid \d+ on .*choose another"):
        RunLock.acquire(tmp_path / "run", context)
    first.release()
    first.release()  # twice is fine
    RunLock.acquire(tmp_path / "run", context).release()


def test_a_job_that_wrote_nothing_leaves_nothing(tmp_path: Path) -> None:
    context = DistributedContext.from_env(environ={})
    lock = RunLock.acquire(tmp_path / "save" / "run", context)
    (tmp_path / "save" / "run" / "hangs").mkdir()  # an empty directory the job made is no write
    lock.release()
    assert not (tmp_path / "save").exists()  # the run directory and the save_dir it created
    (tmp_path / "kept").mkdir()
    lock = RunLock.acquire(tmp_path / "kept" / "run", context)
    (tmp_path / "kept" / "run" / "metrics.jsonl").write_text("{}\n")
    lock.release()
    assert sorted(p.name for p in (tmp_path / "kept" / "run").iterdir()) == [LOCK_FILE, "metrics.jsonl"]


def test_run_lock_on_a_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(TrainingError, match=r"cannot create the lock file .*save_dir to a writable"):
        RunLock.acquire(tmp_path / "file" / "run", DistributedContext.from_env(environ={}))


def test_fault_injection_reads_only_this_ranks_faults(tmp_path: Path) -> None:
    env = {
        "D9D_TEST_RAISE_AT_STEP": "3",
        "D9D_TEST_RAISE_RANK": "1",
        "D9D_TEST_RAISE_ONCE": str(tmp_path / "m"),
    }
    assert FaultInjection.from_env(0, env).raise_step is None
    faults = FaultInjection.from_env(1, env)
    faults.before_step(2)
    with pytest.raises(RuntimeError, match="injected failure on rank 1 at step 3"):
        faults.before_step(3)
    faults.before_step(3)  # once: the marker exists now
    assert FaultInjection.from_env(0, {}) == FaultInjection(rank=0)


def test_watchdog_report_names_stuck_silent_and_waiting_ranks() -> None:
    reports = {0: {"waiting": True, "where": "distributed_c10d.py:1 in all_reduce"},
               1: {"waiting": False, "where": "model.py:7 in forward"}}  # fmt: skip
    text = _message(5, 30.0, reports, [1, 2], 3)
    assert text.startswith("step 5 did not finish within trainer.timeouts.step_s=30 s: ")
    assert "rank 1 is stuck outside any collective at model.py:7 in forward" in text
    assert "rank 2 did not answer" in text and "ranks [0] wait for it in a collective" in text
    everyone_waits = _message(5, 30.0, {0: reports[0], 1: reports[0]}, [], 2)
    assert "every rank waits in a collective, so they called different ones" in everyone_waits
