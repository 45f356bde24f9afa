"""An ordinary step (no log line, no checkpoint) waits for the device at most once.

Every `.item()`, `float(t)`, `bool(t)` and `.tolist()` reaches `aten._local_scalar_dense`, a host
sync on CUDA; a dispatch mode counts them on CPU. Runs of 4 and 8 steps that log and save only at
their last step differ by 4 ordinary steps, so (syncs(8) - syncs(4)) / 4 is the cost of one.
The optimizer runs its fused kernels, as `optimizer.implementation: auto` picks on CUDA (torch's
foreach AdamW reads its CPU step counters with `.item()`: CPU tensors, no device sync there).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "d9d-trainer" / "tests"))
from _dispatch import OpRecorder
from _job import job_config

from d9d.mesh.testing import run_distributed
from d9d.trainer import Trainer


def _syncs(steps: int, mesh: dict | None, save_root: str) -> int:
    config = job_config(save_root, total_steps=steps, mesh=mesh)
    config["trainer"]["logging"]["period_steps"] = 1000  # only the last step logs
    config["trainer"]["checkpointing"]["period_steps"] = 0  # only the last step saves
    config["optimizer"]["implementation"] = "fused"
    with Trainer.from_config(config) as trainer:
        recorder = OpRecorder()
        with recorder:
            trainer.train()
    return recorder.host_syncs


def _per_ordinary_step(save_root: str, mesh: dict | None = None) -> float:
    """The runs of 4 and 8 steps save under save_root/s4 and save_root/s8 (the same dirs on every rank)."""
    return (_syncs(8, mesh, f"{save_root}/s8") - _syncs(4, mesh, f"{save_root}/s4")) / 4


def test_one_host_sync_per_ordinary_step_on_one_process(tmp_path):
    assert _per_ordinary_step(str(tmp_path)) <= 1


@pytest.mark.parametrize(
    "mesh", [{"data_parallel_shard": 2}, {"data_parallel_replicate": 2}], ids=["fsdp2", "ddp2"]
)
def test_one_host_sync_per_ordinary_step_on_two_ranks(tmp_path, mesh):
    per_step = run_distributed(_per_ordinary_step, 2, str(tmp_path), mesh, timeout=120)
    assert all(n <= 1 for n in per_step), per_step
