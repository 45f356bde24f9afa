"""Pre-emption: SIGTERM (or a first Ctrl-C) in the middle of a step finishes that step on every rank,
saves a checkpoint, exits with EXIT_PREEMPTED, and the resumed run equals an uninterrupted one."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faults._harness import (
    STEPS,
    committed_steps,
    job_args,
    losses,
    preload_distributed,
    start_job,
    start_ranks,
)

from d9d.trainer.run.signals import EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[2]
FSDP2 = "mesh.data_parallel_shard=2"


def _signal_env(step: int, rank: int = 0, name: str = "TERM") -> dict[str, str]:
    return {"D9D_TEST_SIGNAL_AT_STEP": str(step), "D9D_TEST_SIGNAL_RANK": str(rank), "D9D_TEST_SIGNAL": name}


def _export(root: Path, name: str) -> bytes:
    return (root / f"{name}-export" / "model.safetensors").read_bytes()


def _grad_norms(run_dir: Path) -> list[float]:
    return [json.loads(line)["grad_norm"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["TERM", "INT"], ids=["sigterm", "ctrl_c"])
def test_signal_mid_step_saves_exits_75_and_resumes_bit_exact(tmp_path, reference, name):
    ref_weights, ref_losses = reference
    args = job_args(tmp_path, "run", STEPS)
    job = start_job(args, tmp_path / "first.log", env=_signal_env(3, name=name))
    assert job.wait() == EXIT_PREEMPTED, job.output()[-3000:]
    out = job.output()
    assert f"stopped by SIG{name} at step 3" in out and "resume with the same command" in out, out[-3000:]
    assert "Traceback" not in out
    assert committed_steps(tmp_path / "run") == [2, 3]  # step 3 is not a periodic save: the signal's
    assert not (tmp_path / "run-export").exists()  # an unfinished run is not exported
    resumed = start_job(args, tmp_path / "second.log")
    assert resumed.wait() == 0, resumed.output()[-3000:]
    assert losses(tmp_path / "run") == ref_losses
    assert _export(tmp_path, "run") == ref_weights


@pytest.fixture(scope="module")
def fsdp2_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, list[float], list[float]]:
    """The uninterrupted FSDP 2 run (forked ranks): its export, losses and grad norms."""
    preload_distributed()
    root = tmp_path_factory.mktemp("fsdp2-ref")
    jobs = start_ranks(2, job_args(root, "ref", STEPS, FSDP2), root)
    assert [j.wait() for j in jobs] == [0, 0], jobs[0].output()[-3000:]
    return _export(root, "ref"), losses(root / "ref"), _grad_norms(root / "ref")


def test_sigterm_on_one_rank_stops_both_after_the_same_step(tmp_path, fsdp2_reference):
    """Only rank 1 gets the signal: the ranks agree inside the step, both save step 3 and exit 75."""
    ref_weights, ref_losses, ref_norms = fsdp2_reference
    args = job_args(tmp_path, "run", STEPS, FSDP2)
    jobs = start_ranks(2, args, tmp_path, env=_signal_env(3, rank=1))
    assert [j.wait() for j in jobs] == [EXIT_PREEMPTED] * 2, (
        jobs[0].output()[-3000:] + jobs[1].output()[-3000:]
    )
    assert committed_steps(tmp_path / "run") == [2, 3]
    assert "stopped by a signal on another rank at step 3" in jobs[0].output()
    assert "stopped by SIGTERM at step 3" in jobs[1].output()
    (tmp_path / "again").mkdir()
    resumed = start_ranks(2, args, tmp_path / "again")
    assert [j.wait() for j in resumed] == [0, 0], resumed[0].output()[-3000:]
    assert losses(tmp_path / "run") == ref_losses
    assert _grad_norms(tmp_path / "run") == ref_norms
    assert _export(tmp_path, "run") == ref_weights


def test_sigterm_to_torchrun_saves_on_both_ranks_and_resumes(tmp_path, fsdp2_reference):
    """The real pre-emption path: SIGTERM to the torchrun agent, which passes it to its workers."""
    ref_weights, ref_losses, _ = fsdp2_reference
    (tmp_path / "logs").mkdir()
    args = job_args(tmp_path, "run", STEPS, FSDP2)
    train = str(ROOT / "examples" / "quickstart" / "train.py")
    config = str(ROOT / "examples" / "quickstart" / "config.yaml")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        train,
        config,
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = (tmp_path / "torchrun.log").open("w")
    agent = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 1):
        assert agent.poll() is None and time.monotonic() < deadline, (tmp_path / "torchrun.log").read_text()[
            -3000:
        ]
        time.sleep(0.01)
    agent.send_signal(signal.SIGTERM)
    agent.wait(timeout=120)
    log.close()
    out = (tmp_path / "torchrun.log").read_text()
    stopped = [
        int(line.split(" at step ")[1].split(";")[0])
        for line in out.splitlines()
        if "stopped by SIGTERM at step" in line
    ]
    assert len(stopped) == 2 and stopped[0] == stopped[1], out[-3000:]  # both ranks, the same step
    # what a scheduler sees (docs/running-jobs.md): the agent's own non-zero status, the ranks' lines
    resumable = out.count("checkpoint saved; resume with the same command")
    assert agent.returncode != 0 and resumable == 2, out[-3000:]
    step = stopped[0]
    assert step < STEPS and step in committed_steps(tmp_path / "run"), out[-3000:]
    (tmp_path / "again").mkdir()
    resumed = start_ranks(2, args, tmp_path / "again")
    assert [j.wait() for j in resumed] == [0, 0], resumed[0].output()[-3000:]
    assert losses(tmp_path / "run") == ref_losses
    assert _export(tmp_path, "run") == ref_weights
