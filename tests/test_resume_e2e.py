"""A killed job resumes to the uninterrupted result; a 2-rank checkpoint resumes on 1 and 4 ranks."""

import shutil
import signal
import subprocess
import sys
import time

import pytest
from _quickstart import CONFIG, TRAIN, losses, overrides, run_local, run_ranks

pytestmark = pytest.mark.slow


def test_killed_run_resumes_to_identical_weights(tmp_path):
    steps = 40
    full = run_local(overrides(tmp_path, "full", steps, f"export.dir={tmp_path / 'export-full'}"))
    assert full.returncode == 0, full.stderr[-3000:]

    args = overrides(
        tmp_path,
        "killed",
        steps,
        "trainer.checkpointing.period_steps=4",
        f"export.dir={tmp_path / 'export-killed'}",
    )
    proc = subprocess.Popen([sys.executable, TRAIN, CONFIG, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})  # fmt: skip
    deadline = time.monotonic() + 240
    while not (tmp_path / "killed" / "save-4").exists():
        assert proc.poll() is None and time.monotonic() < deadline, (
            "the run ended before its first checkpoint"
        )
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / f"save-{steps}").exists(), "killed too late to test a resume"

    resumed = run_local(args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed" in resumed.stdout
    assert losses(tmp_path, "killed") == losses(tmp_path, "full")  # bit-identical, step by step
    full_bytes = (tmp_path / "export-full" / "model.safetensors").read_bytes()
    assert (tmp_path / "export-killed" / "model.safetensors").read_bytes() == full_bytes

    again = run_local(args)  # a finished run says so and exits 0
    assert again.returncode == 0 and "run is already complete" in again.stdout


def test_two_rank_checkpoint_resumes_on_one_and_four_ranks(tmp_path):
    reference = run_local(overrides(tmp_path, "reference", 6))
    assert reference.returncode == 0, reference.stderr[-3000:]
    run_ranks(2, overrides(tmp_path, "fsdp2", 4, "mesh.data_parallel_shard=2"))
    for name in ("on1", "on4"):
        shutil.copytree(tmp_path / "fsdp2", tmp_path / name)
    one = run_local(overrides(tmp_path, "on1", 6))
    assert one.returncode == 0, one.stderr[-3000:]
    run_ranks(4, overrides(tmp_path, "on4", 6, "mesh.data_parallel_shard=4"))
    expected = losses(tmp_path, "reference")
    assert losses(tmp_path, "on1") == pytest.approx(expected, rel=2e-4)
    assert losses(tmp_path, "on4") == pytest.approx(expected, rel=2e-4)
