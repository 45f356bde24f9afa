"""An ordinary step (no log line, no checkpoint) waits for the device at most once.

Every `.item()`, `float(t)`, `bool(t)` and `.tolist()` reaches `aten._local_scalar_dense`, a host
sync on CUDA; a dispatch mode counts them on CPU. Runs of 4 and 8 steps that log and save only at
their last step differ by 4 ordinary steps, so (syncs(8) - syncs(4)) / 4 is the cost of one.
The optimizer runs its fused kernels, as `optimizer.implementation: auto` picks on CUDA (torch's
foreach AdamW reads its CPU step counters with `.item()`: CPU tensors, no device sync there).
The step-time breakdown (`d9d.trainer.observe.timing`) is on in every run; with events that behave as
CUDA's (a read needs a wait that covers the event, the wait counts as a sync) it adds none per step.
"""

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "d9d-trainer" / "tests"))
from _dispatch import OpRecorder
from _job import job_config

from d9d.mesh.testing import run_distributed
from d9d.trainer import Trainer
from d9d.trainer.observe import timing


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


def _moe_quickstart_syncs(save_root: str, mesh_sets: tuple[str, ...]) -> tuple[float, int]:
    """Host syncs per ordinary step of the MoE quickstart (2 MoE layers), from runs of 4 and 8 steps,
    and the microbatches each step runs."""
    from _quickstart import CONFIG, MOE, TINY

    counts = []
    microbatches = 0
    for steps in (4, 8):
        sets = [*TINY, *MOE, *mesh_sets, f"trainer.checkpointing.save_dir={save_root}/s{steps}",
                f"trainer.schedule.total_steps={steps}", "trainer.logging.period_steps=1000",
                "trainer.checkpointing.period_steps=0", "optimizer.implementation=fused"]  # fmt: skip
        with Trainer.from_config(CONFIG, sets) as trainer:
            recorder = OpRecorder()
            with recorder:
                trainer.train()
            assert trainer.plan.batching is not None
            microbatches = trainer.plan.batching.microbatches_per_step
        counts.append(recorder.host_syncs)
    return (counts[1] - counts[0]) / 4, microbatches


def test_a_moe_model_adds_no_host_sync_per_step_on_one_process(tmp_path):
    per_step, _ = _moe_quickstart_syncs(str(tmp_path), ())
    assert per_step <= 1


def test_expert_parallelism_reads_one_split_size_list_per_moe_layer_forward_2ranks(tmp_path):
    sets = ("mesh.data_parallel_shard=2", "mesh.expert_parallel=2")
    for per_step, microbatches in run_distributed(_moe_quickstart_syncs, 2, str(tmp_path), sets, timeout=180):
        assert per_step <= 1 + 2 * microbatches, per_step  # the step's one, one per MoE layer's forward


class _DeviceLikeEvent:
    """Times like `torch.cuda.Event(enable_timing=True)` behaves: `elapsed_time` of an event no wait
    has covered fails (CUDA: not ready), and `synchronize` is a host sync the recorder counts."""

    recorded = 0
    waited_until = 0

    def __init__(self) -> None:
        self._seq = 0
        self._at = 0.0

    def record(self) -> None:
        _DeviceLikeEvent.recorded += 1
        self._seq, self._at = _DeviceLikeEvent.recorded, time.perf_counter()

    def synchronize(self) -> None:
        torch.ones(()).item()  # what a wait for the device costs, as the recorder sees it
        _DeviceLikeEvent.waited_until = max(_DeviceLikeEvent.waited_until, self._seq)

    def elapsed_time(self, end_event: "_DeviceLikeEvent") -> float:
        assert max(self._seq, end_event._seq) <= _DeviceLikeEvent.waited_until, "read an event not waited for"
        return (end_event._at - self._at) * 1e3


def test_device_timing_events_add_no_host_sync_per_ordinary_step(tmp_path, monkeypatch):
    monkeypatch.setattr(timing, "HostEvent", _DeviceLikeEvent)  # what StepTimer.for_device picks on CPU
    monkeypatch.setattr(_DeviceLikeEvent, "waited_until", 0)
    assert _per_ordinary_step(str(tmp_path)) <= 1
    assert _DeviceLikeEvent.waited_until > 0  # the breakdown was timed with these events, and read
