import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _job import job_config, record_states

from d9d.trainer import Trainer
from d9d.trainer.observe.metrics_file import METRICS_FILE


def _train(config, overrides=()):
    with Trainer.from_config(config, overrides) as trainer:
        result = trainer.train()
        params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return result, params


def test_local_run_learns_and_writes_checkpoints_and_metrics(tmp_path):
    result, _ = _train(job_config(str(tmp_path), total_steps=8))
    assert result.start_step == 0 and result.final_step == 8
    assert sum(result.losses[-4:]) / 4 < result.losses[0] * 0.9  # it learns (over a noisy, shuffled order)
    run = tmp_path / "tiny"
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("save-")) == ["save-6", "save-8"]
    records = [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["loss"] for r in records] == pytest.approx(result.losses)


def test_raising_total_steps_continues_to_the_same_weights(tmp_path):
    # a constant LR makes the schedule independent of total_steps, so 4 + 2 steps equal 6 at once
    constant = {"name": "constant", "warmup_steps": 1}
    full, full_params = _train(job_config(str(tmp_path), name="full", total_steps=6, lr_scheduler=constant))
    first, _ = _train(job_config(str(tmp_path), name="split", total_steps=4, lr_scheduler=constant))
    second, split_params = _train(
        job_config(str(tmp_path), name="split", total_steps=6, lr_scheduler=constant)
    )
    assert (first.final_step, second.start_step, second.final_step) == (4, 4, 6)
    assert first.losses + second.losses == full.losses  # bit-identical on one process
    for key, value in full_params.items():
        assert torch.equal(value, split_params[key]), key
    again, _ = _train(job_config(str(tmp_path), name="split", total_steps=6, lr_scheduler=constant))
    assert again.start_step == again.final_step == 6 and again.losses == []


def test_initial_weights_do_not_depend_on_build_order(tmp_path):
    config = job_config(str(tmp_path), total_steps=1)
    with Trainer.from_config(config) as a:
        sa = {k: v.clone() for k, v in a.model.state_dict().items()}
    torch.manual_seed(1234)  # global RNG state must not matter
    with Trainer.from_config(job_config(str(tmp_path), name="other", total_steps=1)) as b:
        sb = b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_export_then_start_a_new_run_from_the_export(tmp_path, capsys):
    from safetensors.torch import load_file

    with Trainer.from_config(job_config(str(tmp_path), name="base", total_steps=2)) as trainer:
        trainer.train()
        out = trainer.export(tmp_path / "export")
        trained = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "d9d.trainer: exported" in line]
    assert "weights=['model.safetensors']" in line  # the log names the files written
    saved = load_file(out / "model.safetensors")
    assert saved.keys() == trained.keys()
    assert all(torch.equal(saved[k], trained[k]) for k in trained)
    config = job_config(str(tmp_path), name="finetune", total_steps=1, model={"import_dir": str(out)})
    with Trainer.from_config(config) as trainer:
        trainer.resume()  # no checkpoint of its own: starts from the import folder
        assert all(torch.equal(trainer.model.state_dict()[k], trained[k]) for k in trained)


def test_nonfinite_loss_stops_and_keeps_the_last_checkpoint(tmp_path):
    from d9d.trainer import TrainingError

    config = job_config(str(tmp_path), total_steps=4)
    config["providers"]["task"] = "_job:NaNAtStepTask"
    with (
        Trainer.from_config(config) as trainer,
        pytest.raises(TrainingError, match=r"step 3: loss nan .* not finite"),
    ):
        trainer.train()
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir() if p.name.startswith("save")) == ["save-2"]


def test_nonfinite_loss_can_skip_the_step(tmp_path):
    config = job_config(str(tmp_path), total_steps=4)
    config["providers"]["task"] = "_job:NaNAtStepTask"
    config["trainer"]["on_nonfinite"] = "skip"
    with Trainer.from_config(config) as trainer:
        after = record_states(trainer)  # weights and AdamW moments after each step
        result = trainer.train()
        params = trainer.model.state_dict()
        assert all(torch.isfinite(v).all() for v in params.values())
    records = [json.loads(line) for line in (tmp_path / "tiny" / METRICS_FILE).read_text().splitlines()]
    assert [r["skipped"] for r in records] == [False, False, True, False]
    assert result.final_step == 4
    # the skipped step changed nothing: weights, moments and AdamW's step count as after step 2
    assert after[2].keys() == after[1].keys()
    assert all(torch.equal(after[2][k], after[1][k]) for k in after[1]), "the skipped step moved the state"
    assert not all(torch.equal(after[3][k], after[2][k]) for k in after[2])  # step 4 updated
    # the schedule follows the step number (trainer.on_nonfinite): the skipped step spends its
    # learning rate, and step 4 uses the 4th (warmup 1 of 4 steps, then a cosine to 0 at the last)
    base = config["optimizer"]["lr"]
    schedule = [base / 2, base, base * 0.5 * (1 + math.cos(math.pi / 2)), 0.0]
    applied = [r["step"] for r in records if not r["skipped"]]
    assert [r["lr"] for r in records if not r["skipped"]] == pytest.approx(
        [schedule[s - 1] for s in applied], abs=1e-15
    )
