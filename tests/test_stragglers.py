"""Stragglers in a running job: a rank slowed on purpose (it sleeps at the start of every step from
step 3 on) is the busiest rank of each of those steps in the records, and after
`trainer.logging.stragglers.steps` of them rank 0 warns once, naming it; the run's numbers are those
of the same run without the slowdown. The busy times travel in the step's one existing sync."""

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _quickstart import NO_CLIP, SGD, TINY, records, train_and_gather

from d9d.mesh.testing import run_distributed


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
