"""Raising total_steps on resume: the learning rate follows the schedule for the new total, and one
warning says when that leaves the checkpoint's course (cosine and linear re-stretched, a wsd
checkpoint past its decay); wsd resumed from its stable phase goes on as the longer run, silently."""

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
    config["trainer"]["logging"]["format"] = "json"
    with Trainer.from_config(config) as trainer:
        trainer.train()
    return [json.loads(line) for line in (save_dir / name / "metrics.jsonl").read_text().splitlines()]


def _warnings(out: str) -> list[dict]:
    """The warnings among the JSON log lines of `out`."""
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [r for r in lines if r.get("level") == "warning"]


def test_wsd_raised_during_its_stable_phase_equals_the_longer_run(tmp_path, capsys):
    """10 steps of warmup-stable-decay, resumed from step 5 (stable) with 20: the 20-step run exactly."""
    wsd = {"name": "wsd", "warmup_steps": 1, "decay_ratio": 0.2}
    longer = _run(tmp_path, "long", 20, wsd)
    _run(tmp_path, "raised", 10, wsd)
    shutil.rmtree(tmp_path / "raised" / "save-10")  # as if the run had stopped after its save at step 5
    capsys.readouterr()
    raised = _run(tmp_path, "raised", 20, wsd)
    assert [r["step"] for r in raised] == list(range(1, 21))
    assert [r["lr"] for r in raised] == [r["lr"] for r in longer]
    assert [r["loss"] for r in raised] == [r["loss"] for r in longer]
    assert [w["event"] for w in _warnings(capsys.readouterr().out)] == ["resumed with a changed setting"]


def test_wsd_resumed_past_its_decay_says_so_and_where_to_resume_from(tmp_path, capsys):
    """A finished wsd run has decayed: raising total_steps from its last checkpoint jumps back to the
    peak, and the one warning says from which checkpoint the extension would not jump."""
    wsd = {"name": "wsd", "warmup_steps": 1, "decay_steps": 3}
    first = _run(tmp_path, "run", 10, wsd)
    assert first[-1]["lr"] == 0.0 and first[6]["lr"] == 1e-2  # steps 8..10 decay, step 7 is the peak's
    capsys.readouterr()
    resumed = _run(tmp_path, "run", 20, wsd)
    assert resumed[10]["lr"] == 1e-2  # back at the peak at step 11
    (warning,) = [
        w for w in _warnings(capsys.readouterr().out) if w["event"] != "resumed with a changed setting"
    ]
    assert warning["event"].startswith(
        "the checkpoint of step 10 is past the start of wsd's decay (step 8 of 10): the learning rate jumps back up "
        "at step 11"
    )
    assert "resume from a checkpoint of step 7 or before" in warning["event"]
    assert (warning["step"], warning["checkpoint_lr"], warning["lr"]) == (11, 0.0, 1e-2)


@pytest.mark.parametrize("name", ["cosine", "linear"])
def test_a_decay_raised_after_its_end_is_re_stretched_with_one_warning_naming_wsd(name, tmp_path, capsys):
    cosine = {"name": name, "warmup_steps": 1}
    first = _run(tmp_path, "run", 5, cosine)
    assert first[-1]["lr"] == 0.0  # a finished run ends at the minimum
    capsys.readouterr()
    resumed = _run(tmp_path, "run", 10, cosine)
    (warning,) = [
        w for w in _warnings(capsys.readouterr().out) if w["event"] != "resumed with a changed setting"
    ]
    assert warning["event"].startswith(f"lr_scheduler {name} is re-stretched over total_steps 10 (was 5)")
    assert "lr_scheduler.name: wsd is the schedule meant for extension" in warning["event"]
    assert (warning["step"], warning["checkpoint_lr"], warning["lr"]) == (6, 0.0, resumed[5]["lr"])
    for record in resumed[5:]:
        want = 1e-2 * lr_multiplier(
            record["step"] - 1, name=name, warmup_steps=1, total_steps=10, min_lr_ratio=0.0
        )
        assert record["lr"] == pytest.approx(want, rel=1e-12), record
    assert resumed[5]["lr"] > 0
