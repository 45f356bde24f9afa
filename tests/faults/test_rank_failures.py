"""One rank of a 2-rank job fails: raising stops the job with that error reported once; hanging stops
every rank within the step timeout, naming the stuck rank. Ranks are real processes (env:// launch)."""

import time

import pytest
from faults._harness import (
    Job,
    committed_steps,
    job_args,
    preload_distributed,
    start_job,
    start_ranks,
    step_dirs,
)

from d9d.trainer.faults.watchdog import EXIT_STEP_TIMEOUT

pytestmark = pytest.mark.slow

TWO_RANKS = "mesh.data_parallel_shard=2"


def _error_lines(jobs: list[Job]) -> list[str]:
    return [line for job in jobs for line in job.output().splitlines() if line.startswith("error:")]


def _wait_all(jobs: list[Job], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(job.poll() is None for job in jobs) and time.monotonic() < deadline:
        time.sleep(0.02)
    for job in jobs:
        job.kill()
    return [job.poll() for job in jobs]  # type: ignore[misc]


def test_one_rank_raises_and_the_job_stops_with_its_error_once(tmp_path):
    preload_distributed()
    env = {"D9D_TEST_RAISE_AT_STEP": "3", "D9D_TEST_RAISE_RANK": "1"}
    args = job_args(tmp_path, "run", 8, TWO_RANKS, "trainer.timeouts.step_s=60")
    ranks = start_ranks(2, args, tmp_path, env)
    wait_start = time.monotonic()
    codes = _wait_all(ranks, timeout=120)
    assert codes == [2, 2], [r.output()[-2000:] for r in ranks]
    assert all(r.ended is not None and r.ended - wait_start < 60 for r in ranks), (
        "a rank waited for a timeout"
    )
    errors = _error_lines(ranks)
    assert errors == ["error: rank 1 failed in step 3: RuntimeError: injected failure on rank 1 at step 3 "
                      "(D9D_TEST_RAISE_AT_STEP) (traceback in rank 1's log)"], errors  # fmt: skip
    rank0, rank1 = (r.output() for r in ranks)
    assert rank1.count("Traceback") == 1 and "injected failure" in rank1  # the failing rank: its traceback
    assert "Traceback" not in rank0 and "stopping: another rank failed first" in rank0  # the other: one line
    assert not any(word in rank0 + rank1 for word in ("Timed out", "Connection reset", "gloo"))
    assert committed_steps(tmp_path / "run") == [2] == step_dirs(tmp_path / "run")


def test_one_rank_hangs_and_every_rank_stops_naming_it(tmp_path):
    preload_distributed()
    step_s = 4.0
    env = {"D9D_TEST_HANG_AT_STEP": "3", "D9D_TEST_HANG_RANK": "1"}
    args = job_args(tmp_path, "run", 8, TWO_RANKS, f"trainer.timeouts.step_s={step_s}")
    ranks = start_ranks(2, args, tmp_path, env)
    rank0 = ranks[0]
    assert committed_steps(tmp_path / "run") == []
    while 2 not in committed_steps(tmp_path / "run"):  # step 3 starts right after the save of step 2
        assert all(r.poll() is None for r in ranks), [r.output()[-2000:] for r in ranks]
        time.sleep(0.01)
    hang_start = time.monotonic()
    codes = _wait_all(ranks, timeout=step_s + 60)
    assert codes == [EXIT_STEP_TIMEOUT] * 2, [r.output()[-2000:] for r in ranks]
    for job in ranks:
        assert job.ended is not None
        assert step_s - 0.5 < job.ended - hang_start < step_s + 5.0, job.ended - hang_start
        assert "rank 1 is stuck outside any collective" in job.output(), job.output()[-2000:]
    errors = _error_lines(ranks)
    assert len(errors) == 1 and errors[0] in rank0.output(), errors
    assert errors[0].startswith(
        "error: step 3 did not finish within trainer.timeouts.step_s=4 s: rank 1 is stuck"
    )
    assert "ranks [0] wait for it in a collective" in errors[0]
    assert "this rank is stuck here" in ranks[1].output() and "before_step" in ranks[1].output()
    run = tmp_path / "run"
    assert committed_steps(run) == [2] == step_dirs(run)
    resumed = start_job(job_args(tmp_path, "run", 4), tmp_path / "resumed.log")  # the checkpoint is sound
    assert resumed.wait() == 0, resumed.output()[-3000:]
    assert "resumed" in resumed.output() and committed_steps(run) == [2, 4]
