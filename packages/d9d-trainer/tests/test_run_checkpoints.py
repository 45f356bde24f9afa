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
    # a degree left out is 1: a config that writes it out, or leaves out the whole section, changes nothing
    assert config_changes({"mesh": {}}, {"mesh": {"tensor_parallel": 1}}) == {}
    assert config_changes({}, {"mesh": {"tensor_parallel": 2}}) == {"mesh.tensor_parallel": (1, 2)}


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


def _resume_logging(config: dict) -> str:
    """Train `config` on this rank with its log lines captured: what it printed."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), Trainer.from_config(config) as trainer:
        trainer.train()
    return out.getvalue()


def test_a_degree_the_checkpoints_config_left_out_is_logged_as_1_on_a_resume_on_another_mesh(tmp_path):
    """Saved on 1 process by a config with no mesh degrees (each 1 by default), resumed on FSDP 2: the
    changed-setting line says checkpoint=1, now=2 (not the absent key's None), for that key alone."""
    from d9d.mesh.testing import run_distributed

    first = job_config(str(tmp_path), total_steps=2)
    first["trainer"]["logging"]["format"] = "json"
    assert first["mesh"] == {}
    assert "resumed" not in _resume_logging(first)
    second = job_config(str(tmp_path), total_steps=4, mesh={"data_parallel_shard": 2})
    second["trainer"]["logging"]["format"] = "json"
    logged = run_distributed(_resume_logging, 2, second, timeout=120)[0]  # rank 0's lines
    lines = [json.loads(line) for line in logged.splitlines() if line.startswith("{")]
    changed = {
        r["key"]: (r["checkpoint"], r["now"])
        for r in lines
        if r.get("event") == "resumed with a changed setting"
    }
    assert changed == {"mesh.data_parallel_shard": (1, 2), "trainer.schedule.total_steps": (2, 4)}
    (world,) = [r for r in lines if r.get("event") == "resumed on another world"]
    assert (world["checkpoint_world"], world["world"]) == (1, 2)
    assert (world["checkpoint_mesh"], world["mesh"]) == ("all degrees 1", "data_parallel_shard=2")
