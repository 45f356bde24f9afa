"""Raising total_steps on resume: the learning rate follows the schedule for the new total."""

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _job import job_config

from d9d.trainer import Trainer
from d9d.trainer.builtins.optim import lr_multiplier


def _run(save_dir: Path, name: str, steps: int, schedule: dict) -> list[dict]:
    config = job_config(str(save_dir), name=name, total_steps=steps, lr_scheduler=schedule)
    config["trainer"]["checkpointing"]["period_steps"] = 5
    with Trainer.from_config(config) as trainer:
        trainer.train()
    return [json.loads(line) for line in (save_dir / name / "metrics.jsonl").read_text().splitlines()]


def test_wsd_raised_during_its_stable_phase_equals_the_longer_run(tmp_path):
    """10 steps of warmup-stable-decay, resumed from step 5 (stable) with 20: the 20-step run exactly."""
    wsd = {"name": "wsd", "warmup_steps": 1, "decay_ratio": 0.2}
    longer = _run(tmp_path, "long", 20, wsd)
    _run(tmp_path, "raised", 10, wsd)
    shutil.rmtree(tmp_path / "raised" / "save-10")  # as if the run had stopped after its save at step 5
    raised = _run(tmp_path, "raised", 20, wsd)
    assert [r["step"] for r in raised] == list(range(1, 21))
    assert [r["lr"] for r in raised] == [r["lr"] for r in longer]
    assert [r["loss"] for r in raised] == [r["loss"] for r in longer]


def test_cosine_raised_after_its_end_continues_on_the_new_curve_not_at_zero(tmp_path):
    cosine = {"name": "cosine", "warmup_steps": 1}
    first = _run(tmp_path, "run", 5, cosine)
    assert first[-1]["lr"] == pytest.approx(
        1e-2 * lr_multiplier(4, name="cosine", warmup_steps=1, total_steps=5, min_lr_ratio=0.0)
    )
    resumed = _run(tmp_path, "run", 10, cosine)
    for record in resumed[5:]:
        want = 1e-2 * lr_multiplier(
            record["step"] - 1, name="cosine", warmup_steps=1, total_steps=10, min_lr_ratio=0.0
        )
        assert record["lr"] == pytest.approx(want, rel=1e-12), record
    assert resumed[5]["lr"] > 0
