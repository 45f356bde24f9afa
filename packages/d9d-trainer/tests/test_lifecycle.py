"""What a resume says about settings that changed since the checkpoint was written."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _job import job_config

from d9d.trainer import Trainer
from d9d.trainer.lifecycle import config_changes


def test_config_changes_lists_each_changed_leaf_of_the_watched_sections():
    saved = {
        "mesh": {"data_parallel_shard": 2},
        "optimizer": {"lr": 0.1},
        "trainer": {"schedule": {"total_steps": 4}, "run": {"name": "a"}},
    }
    now = {
        "mesh": {"data_parallel_shard": 4},
        "optimizer": {"lr": 0.1},
        "trainer": {"schedule": {"total_steps": 8}, "run": {"name": "b"}},
    }
    assert config_changes(saved, now) == {
        "mesh.data_parallel_shard": (2, 4),
        "trainer.schedule.total_steps": (4, 8),
    }
    assert config_changes(None, now) == {}


def test_a_resume_with_more_steps_logs_the_change_once(tmp_path, capsys):
    with Trainer.from_config(job_config(str(tmp_path), total_steps=2)) as trainer:
        trainer.train()
    config = job_config(str(tmp_path), total_steps=4)
    config["trainer"]["logging"]["format"] = "json"
    with Trainer.from_config(config) as trainer:
        trainer.train()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    changed = [r for r in lines if r.get("event") == "resumed with a changed setting"]
    assert [(r["key"], r["checkpoint"], r["now"]) for r in changed] == [
        ("trainer.schedule.total_steps", 2, 4)
    ]
