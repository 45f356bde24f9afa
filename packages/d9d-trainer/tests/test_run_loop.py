"""The run loop's decisions and its one place between steps (`PreparesSteps`)."""

import itertools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _job import job_config

from d9d.trainer import CausalLMTask, ConfigError, Trainer, load_job_config, resolve_job
from d9d.trainer.providers import LossContext, PrepareStepContext
from d9d.trainer.run.checkpoints import SavePolicy


@pytest.mark.parametrize(
    ("step", "last", "requested", "stopping", "finishing", "period", "on_signal", "due"),
    [
        (4, False, False, False, False, 2, True, True),  # periodic
        (3, False, False, False, False, 2, True, False),
        (3, True, False, False, False, 2, True, True),  # the last step always saves
        (3, False, True, False, False, 2, True, True),  # a callback asked
        (3, False, False, False, True, 2, True, True),  # early stopping or a callback ends the run
        (3, False, False, False, True, 2, False, True),  # ... finished: saved whatever save_on_signal says
        (3, False, False, True, False, 2, True, True),  # a signal, save_on_signal
        (3, False, False, True, False, 2, False, False),  # a signal, save_on_signal: false
        (4, False, False, False, False, 0, True, False),  # period 0: only at the end
    ],
)
def test_the_save_policy(step, last, requested, stopping, finishing, period, on_signal, due):
    policy = SavePolicy(period=period, on_signal=on_signal)
    assert policy.due(step, last=last, requested=requested, stopping=stopping, finishing=finishing) is due


def _weights(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


class PrepareFromData(CausalLMTask):
    """Makes each step from the data provider's next one, as the loop would; records what it saw."""

    seen: list[tuple[int, float]]

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.seen = []

    def prepare_step(self, context: PrepareStepContext) -> Any:
        self.seen.append((context.step, _weights(context.model)))
        return next(context.data)


class RepeatFirstMicrobatch(CausalLMTask):
    """Swaps the batch source: every microbatch of a step is the step's first one."""

    def prepare_step(self, context: PrepareStepContext) -> Any:
        microbatches = next(context.data)
        return [microbatches[0]] * len(microbatches)


def _train(config: dict) -> tuple[Any, list[float], float]:
    job = resolve_job(load_job_config(config))
    with Trainer(job) as trainer:
        initial = _weights(trainer.model)
        result = trainer.train()
    return job.task, result.losses, initial


def test_prepare_step_sees_each_step_in_order_with_the_weights_of_the_step_before(tmp_path):
    plain = job_config(str(tmp_path), name="plain", total_steps=4)
    _, losses, _ = _train(plain)
    prepared = job_config(str(tmp_path), name="prepared", total_steps=4)
    prepared["providers"]["task"] = f"{__name__}:PrepareFromData"
    task, prepared_losses, initial = _train(prepared)
    assert prepared_losses == losses  # drawing from the data there is what the loop does without it
    assert [step for step, _ in task.seen] == [1, 2, 3, 4]
    sums = [weights for _, weights in task.seen]
    assert sums[0] == initial  # step 1 is prepared on the initial weights
    assert all(a != b for a, b in itertools.pairwise(sums))  # then on each update's

    # a resumed run prepares the steps it has left, from the data position of its checkpoint
    prepared["trainer"]["schedule"]["total_steps"] = 6
    task, more, _ = _train(prepared)
    assert [step for step, _ in task.seen] == [5, 6]
    plain["trainer"]["schedule"]["total_steps"] = 6
    _, plain_more, _ = _train(plain)
    assert more == plain_more


def test_the_step_trains_on_what_prepare_step_returns(tmp_path):
    config = job_config(str(tmp_path), name="repeat", total_steps=1)
    config["providers"]["task"] = f"{__name__}:RepeatFirstMicrobatch"
    with Trainer.from_config(job_config(str(tmp_path), name="look", total_steps=1)) as trainer:
        first = next(iter(trainer.data))[0]  # the same initial weights and data order (same seeds)
        result = CausalLMTask().compute_loss(
            LossContext(model=trainer.model, batch=first, device=torch.device("cpu"))
        )
        expected = float(result.loss_sum / result.weight)
    _, plain, _ = _train(job_config(str(tmp_path), name="plain", total_steps=1))
    _, losses, _ = _train(config)
    assert losses[0] == pytest.approx(expected, rel=1e-6)
    assert losses[0] != pytest.approx(plain[0], rel=1e-4)


class NotAMethod(CausalLMTask):
    prepare_step = 3


def test_an_attribute_named_prepare_step_is_refused(tmp_path):
    config = job_config(str(tmp_path), total_steps=1)
    config["providers"]["task"] = f"{__name__}:NotAMethod"
    with pytest.raises(ConfigError, match=r"prepare_step.*PreparesSteps"):
        resolve_job(load_job_config(config))


def test_the_train_path_checks_the_settings_once_and_resolves_the_paths_once(tmp_path, monkeypatch):
    """`run_job` (what `python train.py` and `d9d train` run): the rules of a config are checked when it
    is loaded, and its directories are resolved there, not again by the resolve, the finished-run
    check, the Trainer or the export."""
    import yaml

    import d9d.trainer.job.load as load_module
    from d9d.trainer import run_job
    from d9d.trainer.job.paths import JobPaths

    calls = {"settings": 0, "paths": 0}
    check, of = load_module.check_job_settings, JobPaths.of.__func__

    def counted_check(*args, **kwargs):
        calls["settings"] += 1
        return check(*args, **kwargs)

    def counted_of(cls, *args, **kwargs):
        calls["paths"] += 1
        return of(cls, *args, **kwargs)

    monkeypatch.setattr(load_module, "check_job_settings", counted_check)
    monkeypatch.setattr(JobPaths, "of", classmethod(counted_of))
    config = job_config(str(tmp_path / "runs"), total_steps=2, export={"dir": str(tmp_path / "export")})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_job(path)
    assert result.final_step == 2 and any((tmp_path / "export").iterdir())
    assert calls == {"settings": 1, "paths": 1}
