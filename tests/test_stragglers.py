"""Stragglers in a running job: a rank slowed on purpose (it sleeps at the start of every step from
step 3 on) is the busiest rank of each of those steps in the records, and after
`trainer.logging.stragglers.steps` of them rank 0 warns once, naming it; the run's numbers are those
of the same run without the slowdown. The busy times travel in the step's one existing sync.

The ratio is the busiest rank's time over the *median* rank's: with two ranks the median is the
mean, so the fields are checked on 3 and 4 ranks too, by hand and in a real 4-rank run, where the
median and the mean of the gathered times differ."""

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _quickstart import NO_CLIP, SGD, TINY, records, train_and_gather

from d9d.mesh.testing import run_distributed
from d9d.trainer.observe.stragglers import straggler_fields


def _run(tmp_path: Path, name: str, env: dict[str, str]) -> tuple[list[dict], list[dict]]:
    args = [*TINY, *SGD, *NO_CLIP, "mesh.data_parallel_shard=2", f"trainer.checkpointing.save_dir={tmp_path}",
            f"trainer.run.name={name}", "trainer.schedule.total_steps=8", "trainer.checkpointing.period_steps=0",
            "trainer.logging.stragglers={ratio: 1.3, steps: 3}", "trainer.logging.format=json",
            f"trainer.logging.log_dir={tmp_path / name / 'logs'}"]  # fmt: skip
    run_distributed(train_and_gather, 2, args, env={"OMP_NUM_THREADS": "1", **env}, timeout=240)
    log = (tmp_path / name / "logs" / "rank-0.log").read_text().splitlines()
    return records(tmp_path / name), [json.loads(x) for x in log if '"straggler' in x]


def test_a_slowed_rank_is_recorded_as_the_straggler_and_warned_about_once(tmp_path):
    slow = {"D9D_TEST_SLOW_RANK": "1", "D9D_TEST_SLOW_STEP_S": "0.3", "D9D_TEST_SLOW_FROM_STEP": "3"}
    slowed, warnings = _run(tmp_path, "slowed", slow)
    for record in slowed[2:]:  # rank 1 sleeps 0.3 s a step: rank 0 waits for it in FSDP's collectives
        assert record["straggler_rank"] == 1 and record["straggler_time_s"] >= 0.3, record
        assert record["straggler_ratio"] > 1.3, record  # the median of two is their mean: at most 2
    (warning,) = warnings
    assert warning["event"] == "straggler" and warning["where"] == "rank 1 dps1"
    assert warning["step"] == 5 and warning["steps"] == 3 and warning["level"] == "warning"
    summary = subprocess.run([sys.executable, "-m", "d9d.cli", "metrics", str(tmp_path / "slowed")],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    (line,) = [x for x in summary.splitlines() if x.startswith("busiest rank: ")]
    assert line.startswith("busiest rank: rank 1 in ") and " of 8 steps (median " in line, line
    healthy, quiet = _run(tmp_path, "healthy", {})
    assert quiet == [] and all(r["straggler_time_s"] < 0.3 for r in healthy)
    for ours, theirs in zip(slowed, healthy, strict=True):  # a slow rank changes no number
        assert ours["loss"] == theirs["loss"] and ours["grad_norm"] == theirs["grad_norm"]


#: (every rank's busy time, the busiest rank, its ratio to the median rank), worked out by hand; the
#: ratio to the mean is in each comment, where it differs.
_FIELDS = [
    ([1.0, 3.0], 1, 1.5),  # two ranks: median = mean = 2
    ([1.0, 2.0, 6.0], 2, 3.0),  # median 2; mean 3 would give 2.0
    ([5.0, 1.0, 2.0], 0, 2.5),  # the busiest first: median 2; mean 8/3 would give 1.875
    ([1.0, 1.0, 1.0, 4.0], 3, 4.0),  # median 1; mean 1.75 would give 2.29
    ([1.0, 9.0, 2.0, 4.0], 1, 3.0),  # even count: median (2 + 4) / 2 = 3; mean 4 would give 2.25
    ([2.0, 2.0, 1.0], 0, 1.0),  # a tie for the busiest: the lower rank
    ([0.0, 0.0, 0.0], 0, 1.0),  # nobody busy (median 0): no straggler
]


@pytest.mark.parametrize(("busy", "rank", "ratio"), _FIELDS)
def test_the_straggler_ratio_is_over_the_median_rank(busy, rank, ratio):
    fields = straggler_fields(busy)
    assert fields == {"straggler_rank": rank, "straggler_time_s": busy[rank], "straggler_ratio": ratio}


def _train_spying(args: list[str]) -> list[list[float]]:
    """Train the quickstart on this rank; the busy times the records' `straggler_fields` got, per step."""
    from d9d.trainer.observe import records

    seen: list[list[float]] = []
    original = records.straggler_fields

    def spy(busy: list[float]) -> dict[str, Any]:
        seen.append(list(busy))
        return original(busy)

    records.straggler_fields = spy
    train_and_gather(args)
    return seen


def test_four_ranks_record_the_gathered_times_busiest_over_their_median(tmp_path):
    """A real 4-rank run (FSDP 4), rank 2 slowed: every record's ratio is the slowed rank's time over
    the median of the four gathered times, which here is not their mean."""
    args = [*TINY, *SGD, "mesh.data_parallel_shard=4", f"trainer.checkpointing.save_dir={tmp_path}",
            "trainer.run.name=four", "trainer.schedule.total_steps=3", "trainer.checkpointing.period_steps=0"]  # fmt: skip
    slow = {"OMP_NUM_THREADS": "1", "D9D_TEST_SLOW_RANK": "2", "D9D_TEST_SLOW_STEP_S": "0.3"}
    gathered = run_distributed(_train_spying, 4, args, env=slow, timeout=240)[0]
    steps = records(tmp_path / "four")
    assert len(gathered) == len(steps) == 3
    for busy, record in zip(gathered, steps, strict=True):
        assert len(busy) == 4 and max(busy) == busy[2] >= 0.3, busy  # rank order: the slowed rank is 2
        assert record["straggler_rank"] == 2 and record["straggler_time_s"] == busy[2], record
        median, mean = statistics.median(busy), statistics.fmean(busy)
        assert median != pytest.approx(mean, rel=1e-6), busy  # the run tells them apart
        assert record["straggler_ratio"] == pytest.approx(busy[2] / median, rel=1e-12), (record, busy)
