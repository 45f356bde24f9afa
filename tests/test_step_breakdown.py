"""Every metrics.jsonl record carries tokens/s, peak memory and the step-time breakdown
(`d9d.trainer.observe.timing`): data wait, forward+backward and optimizer add up to the step time, a slow
dataset shows as data wait, a checkpoint's stall shows on the record after it, on one process, PP 2
and FSDP 2. Timing events are read only when the records flush (the CUDA path, through a stand-in
event class: no CUDA numbers are made up here)."""

import time
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import pytest
import torch
from _quickstart import overrides, records, train

from d9d.cli.commands.metrics import summarize
from d9d.data import TextDataset
from d9d.trainer.observe.records import StepRecords
from d9d.trainer.observe.timing import PHASES, StepTimer
from d9d.trainer.providers import BuildDatasetContext, BuildDatasetResult
from d9d.trainer.step.base import StepOutput

#: The quickstart's 16-sample global batch loads 16 samples per step on one process.
SAMPLES_PER_STEP = 16
SLEEP_PER_SAMPLE_S = 0.005
STEP_PHASES = [f"time_{p}_s" for p in PHASES if p != "checkpoint"]


class _SlowCorpusConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str = "../data/corpus.txt"
    seq_len: int = 128
    sleep_s: float = 0.0


class _SlowText(TextDataset):
    """The quickstart corpus, `sleep_s` slower per sample (a slow disk or tokenizer)."""

    sleep_s = 0.0

    def __getitem__(self, index: int) -> Any:
        time.sleep(self.sleep_s)
        return super().__getitem__(index)


class SlowCorpusProvider:
    """The quickstart's dataset provider with a sleep per sample (named by path in the job)."""

    config_type = _SlowCorpusConfig

    def __init__(self, config: _SlowCorpusConfig) -> None:
        self.config = config

    def build_dataset(self, context: BuildDatasetContext) -> BuildDatasetResult:
        dataset = _SlowText(Path(context.base_dir) / self.config.path, self.config.seq_len)
        dataset.sleep_s = self.config.sleep_s
        return BuildDatasetResult(dataset=dataset)


def _check_breakdown(record: dict[str, Any]) -> None:
    """The step phases are positive and add up to about the step time (they lie inside it)."""
    phases = [record[key] for key in STEP_PHASES]
    assert all(value > 0 for value in phases), record
    assert record["time_checkpoint_s"] >= 0, record
    total, step = sum(phases), record["step_time_s"]
    assert 0.5 * step <= total <= step + 1e-3, (total, step, record)
    assert record["tokens_per_s"] == pytest.approx(record["tokens"] / step)
    assert record["peak_rss_gib"] > 0  # CPU: the process's peak resident memory
    assert "mfu" not in record  # no known peak for a CPU: never a made-up number


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Five steps on one process, checkpoints after steps 2 and 4 (written synchronously)."""
    root = tmp_path_factory.mktemp("breakdown")
    train(1, overrides(root, "one", 5, "trainer.checkpointing.async_save=false"))
    return records(root / "one")


def test_phases_add_up_to_the_step_time_on_one_process(one_process):
    assert [r["step"] for r in one_process] == [1, 2, 3, 4, 5]
    for record in one_process:
        _check_breakdown(record)


def test_a_checkpoint_stall_shows_on_the_record_after_it(one_process):
    stalls = {r["step"]: r["time_checkpoint_s"] for r in one_process}
    assert stalls[3] > 0 and stalls[5] > 0, stalls  # save-2 and save-4 blocked the loop
    assert stalls[1] == stalls[2] == stalls[4] == 0.0, stalls


def test_d9d_metrics_sums_up_the_breakdown(one_process):
    summary = summarize(one_process)
    assert summary.breakdown is not None
    assert list(summary.breakdown) == ["data", "forward+backward", "optimizer"]
    assert 0.5 <= sum(summary.breakdown.values()) <= 1.0 + 1e-6
    assert summary.checkpoint_stall_s == pytest.approx(sum(r["time_checkpoint_s"] for r in one_process))
    untimed = [{k: v for k, v in r.items() if not k.startswith("time_")} for r in one_process]
    assert summarize(untimed).breakdown is None  # records of a trainer before the breakdown


def test_a_slow_dataset_shows_as_data_wait(tmp_path, one_process):
    slow = f"providers.dataset={__file__}:SlowCorpusProvider"
    train(1, overrides(tmp_path, "slow", 3, slow, f"dataset.sleep_s={SLEEP_PER_SAMPLE_S}",
                       "data.num_workers=0"))  # fmt: skip
    sleep = SAMPLES_PER_STEP * SLEEP_PER_SAMPLE_S
    waits = [r["time_data_s"] for r in records(tmp_path / "slow")]
    assert all(wait >= sleep for wait in waits), (waits, sleep)
    assert max(r["time_data_s"] for r in one_process) < sleep  # the same job without the sleep
    for record in records(tmp_path / "slow"):
        _check_breakdown(record)


@pytest.mark.parametrize(
    "mesh", ["mesh.pipeline_parallel=2", "mesh.data_parallel_shard=2"], ids=["pp2", "fsdp2"]
)
def test_the_breakdown_is_recorded_on_two_ranks(tmp_path, mesh):
    train(2, overrides(tmp_path, "two", 3, mesh, "trainer.checkpointing.async_save=false"))
    found = records(tmp_path / "two")
    assert [r["step"] for r in found] == [1, 2, 3]
    for record in found:
        _check_breakdown(record)
    assert found[2]["time_checkpoint_s"] > 0  # save-2


# ---------------------------------------------------------------------------------------- the CUDA path


class _WatchedEvent:
    """A stand-in for `torch.cuda.Event(enable_timing=True)`: host times, and a log of every read."""

    reads: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self._at: float | None = None

    def record(self) -> None:
        self._at = time.perf_counter()

    def synchronize(self) -> None:
        _WatchedEvent.reads.append("synchronize")

    def elapsed_time(self, end_event: "_WatchedEvent") -> float:
        _WatchedEvent.reads.append("elapsed_time")
        assert self._at is not None and end_event._at is not None, "read before it was recorded"
        return (end_event._at - self._at) * 1e3


def _output() -> StepOutput:
    return StepOutput(
        loss=torch.tensor(2.0), grad_norm=torch.tensor(1.0), weight=torch.tensor(64.0), applied=True
    )


def _mark_step(timer: StepTimer) -> None:
    timer.begin()
    for phase in ("data", "forward_backward", "optimizer"):
        time.sleep(0.001)
        timer.mark(phase)


def test_timing_events_are_read_only_when_the_records_flush(tmp_path):
    _WatchedEvent.reads = []
    timer = StepTimer(_WatchedEvent)
    kept = StepRecords(tmp_path / "metrics.jsonl", writer=True, total=100, period=50, launch="x", first=1,
                       peak_flops=None, world_size=1, device=torch.device("cpu"))  # fmt: skip
    _mark_step(timer)
    kept.add(1, _output(), lr=0.1, step_time_s=0.01, phases=timer.take())  # the first step logs at once
    assert _WatchedEvent.reads.count("synchronize") == 1
    _WatchedEvent.reads = []
    timer.begin()
    time.sleep(0.002)
    timer.mark("checkpoint")  # a checkpoint after step 1: its stall goes on step 2's record
    for step in (2, 3, 4):  # ordinary steps: marked, never read
        _mark_step(timer)
        kept.add(step, _output(), lr=0.1, step_time_s=0.01, phases=timer.take())
    assert _WatchedEvent.reads == []
    kept.flush()
    assert _WatchedEvent.reads[0] == "synchronize"  # one wait on the latest event, then the reads
    assert _WatchedEvent.reads.count("synchronize") == 1
    assert _WatchedEvent.reads.count("elapsed_time") == 3 * 3 + 1
    found = records(tmp_path)
    assert [r["step"] for r in found] == [1, 2, 3, 4]
    assert found[1]["time_checkpoint_s"] >= 0.002 and found[2]["time_checkpoint_s"] == 0.0
    assert all(r[key] >= 0.001 for r in found for key in STEP_PHASES)
    timer.mark("data")  # outside begin() .. take(): a step run outside the loop marks nothing
    assert timer.take().spans == ()
