"""What a resume says about settings that changed since the checkpoint, and the LR it resumes with."""

import json
import sys
from pathlib import Path

import torch
from torch.optim.lr_scheduler import LambdaLR, MultiplicativeLR

sys.path.insert(0, str(Path(__file__).parent))
from _job import job_config

from d9d.trainer import Trainer
from d9d.trainer.run.checkpoints import _reapply_schedule, config_changes


def test_config_changes_lists_each_changed_leaf_of_the_watched_sections():
    saved = {
        "mesh": {"data_parallel_shard": 2},
        "optimizer": {"lr": 0.1},
        "trainer": {"schedule": {"total_steps": 4}, "run": {"name": "a"}},
    }
    now = {
        "mesh": {"data_parallel_shard": 4},
        "optimizer": {"lr": 0.1},
        "trainer": {"schedule": {"total_steps": 8}, "run": {"name": "b"}, "determinism": {"seed": 3}},
    }
    assert config_changes(saved, now) == {
        "mesh.data_parallel_shard": (2, 4),
        "trainer.schedule.total_steps": (4, 8),
        "trainer.determinism.seed": (None, 3),  # a changed seed gets its notice too
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


def test_a_resume_reapplies_a_lambda_schedule_and_leaves_other_schedulers_alone():
    weight = torch.nn.Parameter(torch.zeros(1))
    for scheduler_type, expected in ((LambdaLR, 0.05), (MultiplicativeLR, 0.3)):
        optimizer = torch.optim.SGD([weight], lr=0.1)
        scheduler = scheduler_type(optimizer, lambda step: 0.5)
        optimizer.param_groups[0]["lr"] = 0.3  # what the checkpoint's old schedule gave
        _reapply_schedule(scheduler, optimizer)
        assert optimizer.param_groups[0]["lr"] == expected
