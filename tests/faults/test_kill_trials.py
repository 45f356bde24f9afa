"""SIGKILL at seeded random points (mid-step, mid-write, before the commit, mid-retention): every
restart resumes from a committed checkpoint and the finished run equals an uninterrupted one, bit for bit."""

import random
from pathlib import Path

import pytest
from faults._harness import STEPS, committed_steps, job_args, losses, start_job, step_dirs, wait_for

from d9d.ckpt.checkpoint._testhooks import PAUSE_BEFORE_COMMIT_ENV, PAUSE_IN_PRUNE_ENV

pytestmark = pytest.mark.slow

TRIALS = 20
MODES = ("step", "write", "commit", "retention")


def _temp_dirs(run_dir: Path, pattern: str) -> set[str]:
    return {p.name for p in run_dir.glob(pattern)} if run_dir.is_dir() else set()


def _kill_once(rng: random.Random, args: list[str], run_dir: Path, log: Path, resumed_from: int) -> str:
    """Start the job, SIGKILL it at a random point after `resumed_from`; what was hit."""
    saves = [s for s in range(resumed_from + 2, STEPS + 1, 2)]
    mode = rng.choice(MODES)
    if mode == "retention":
        saves = [s for s in saves if s >= 6]
        mode = mode if saves else "write"
    step = rng.choice(saves) if saves else STEPS
    env: dict[str, str] = {}
    if mode == "commit":
        env[PAUSE_BEFORE_COMMIT_ENV] = f"60@{step}"
    if mode == "retention":
        env[PAUSE_IN_PRUNE_ENV] = f"60@{step}"
    old_tmp = _temp_dirs(run_dir, f".save-{step}.tmp-*")
    old_trash = _temp_dirs(run_dir, ".trash-save-*")
    job = start_job(args, log, env)
    if mode == "step":  # somewhere inside a step (or the save right after it)
        target = rng.randint(resumed_from, STEPS - 1)
        reached = wait_for(lambda: job.last_step() >= target, job, what=f"step {target}")
        delay = rng.uniform(0.0, 0.05)
    elif mode == "write":  # while the checkpoint's files are written
        reached = wait_for(
            lambda: bool(_temp_dirs(run_dir, f".save-{step}.tmp-*") - old_tmp), job, what="a save"
        )
        delay = rng.uniform(0.0, 0.02)
    elif mode == "commit":  # every file written, commit not done yet
        reached = wait_for(
            lambda: any(
                (run_dir / d / ".metadata").exists() for d in _temp_dirs(run_dir, ".save-*") - old_tmp
            ),
            job,
            what="a written save",
        )
        delay = 0.05
    else:  # an old checkpoint renamed aside, not deleted yet
        reached = wait_for(
            lambda: bool(_temp_dirs(run_dir, ".trash-save-*") - old_trash), job, what="retention"
        )
        delay = 0.0
    assert reached, f"the job ended before the {mode} kill point:\n{job.output()[-3000:]}"
    job.process.join(delay)
    job.kill()
    assert job.poll() == -9, job.output()[-3000:]
    return f"{mode}@{step}"


def _resumed_from(text: str) -> int:
    """The step a job's log says it resumed from (0: it started from scratch)."""
    marker = "d9d.trainer: resumed"
    if marker not in text:
        return 0
    line = text[text.index(marker) :].splitlines()[0]
    return int(line.split("step=")[1].split()[0])


@pytest.mark.parametrize("seed", range(TRIALS))
def test_sigkill_then_restart_equals_uninterrupted_run(tmp_path, reference, seed):
    rng = random.Random(seed)
    args = job_args(tmp_path, "run", STEPS)
    run_dir = tmp_path / "run"
    latest = 0  # the committed checkpoint the next start must resume from
    hits: list[str] = []
    for kill in range(rng.choice((1, 1, 2))):
        if latest == STEPS:  # the first kill came after the last commit: nothing left to interrupt
            break
        log = tmp_path / f"killed-{kill}.log"
        hits.append(_kill_once(rng, args, run_dir, log, latest))
        assert _resumed_from(log.read_text()) == latest, f"{hits}: a restart did not resume from the latest"
        committed = committed_steps(run_dir)
        assert step_dirs(run_dir) == committed, f"an uncommitted save-<step> after {hits}"
        latest = committed[-1] if committed else 0
    final = start_job(args, tmp_path / "final.log")
    assert final.wait() == 0, f"{hits}\n{final.output()[-3000:]}"
    assert _resumed_from(final.output()) == latest, (
        f"{hits}: did not resume from the latest committed checkpoint"
    )
    weights, expected_losses = reference
    assert losses(run_dir) == expected_losses, hits
    assert (tmp_path / "run-export" / "model.safetensors").read_bytes() == weights, hits
    assert not list(run_dir.glob(".save-*")) and not list(run_dir.glob(".trash-*")), "crash leftovers remain"
