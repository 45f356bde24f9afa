"""Two jobs with the same run at once: the second refuses with one clear error; a crash frees the run."""

import pytest
from faults._harness import job_args, preload_distributed, start_job, start_ranks, wait_for

pytestmark = pytest.mark.slow


def test_second_job_refuses_and_a_killed_job_releases_the_run(tmp_path):
    long_run = job_args(tmp_path, "run", 100_000, "trainer.checkpointing.period_steps=0")
    first = start_job(long_run, tmp_path / "first.log")
    try:
        wait_for(lambda: first.last_step() >= 1, first, what="the first job's first step")
        second = start_job(long_run, tmp_path / "second.log")
        assert second.wait() == 2
        out = second.output()
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, out
        assert f"run {tmp_path / 'run'} is in use by another job (pid {first.process.pid}" in errors[0]
        assert "choose another trainer.run.name" in errors[0]
        assert "d9d.trainer: step" not in out and "resumed" not in out  # it trained nothing
        steps_then = first.last_step()
        wait_for(lambda: first.last_step() > steps_then, first, what="the first job to go on")

        # Two ranks under one launch: rank 0 tries the lock, both refuse together, one error line.
        preload_distributed()
        ranks = start_ranks(2, [*long_run, "mesh.data_parallel_shard=2"], tmp_path)
        assert [r.wait() for r in ranks] == [2, 2]
        lines = [ln for r in ranks for ln in r.output().splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and "is in use by another job" in lines[0], [r.output() for r in ranks]
    finally:
        first.kill()
    assert first.poll() == -9
    third = start_job(job_args(tmp_path, "run", 2), tmp_path / "third.log")  # the kill freed the run
    assert third.wait() == 0, third.output()[-3000:]
