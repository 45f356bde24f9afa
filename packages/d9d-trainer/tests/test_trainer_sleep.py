"""`Trainer.sleep()` / `wake()` between steps (an RL loop's inference phase): a run that sleeps and wakes
after every step gives the same losses, weights and optimizer states as one that never sleeps, bit for
bit, on one process and on FSDP 2 (forked gloo ranks); while asleep the Trainer refuses in one line."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _job import job_config, record_states

from d9d.mesh.testing import run_distributed
from d9d.trainer import Trainer, TrainingError


def _refused(call) -> str:
    with pytest.raises(TrainingError) as info:
        call()
    assert "\n" not in str(info.value) and "Trainer.wake()" in str(info.value)
    return str(info.value)


def _sleep_after_every_step(trainer: Trainer) -> list[int]:
    """After each step: sleep, check what is refused, wake. The list fills with the bytes moved."""
    moved: list[int] = []
    run = trainer.train_step.run

    def sleeping(microbatches, step):
        output = run(microbatches, step)
        moved.append(trainer.sleep())
        assert "cannot train" in _refused(trainer.train)
        assert "cannot save" in _refused(trainer.save_checkpoint)
        assert "cannot export" in _refused(trainer.export)
        trainer.wake()
        return output

    trainer.train_step.run = sleeping
    return moved


def _run(config: dict, sleep: bool) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    with Trainer.from_config(config) as trainer:
        moved = _sleep_after_every_step(trainer) if sleep else None
        states = record_states(trainer)  # recorded after the wake
        result = trainer.train()
    if moved is not None:
        assert len(moved) == len(result.losses) and all(n > 0 for n in moved)
    return result.losses, states


def _assert_same(slept, awake) -> None:
    (losses, states), (want_losses, want_states) = slept, awake
    assert losses == want_losses and len(states) == len(want_states) == 3
    for got, want in zip(states, want_states, strict=True):
        assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


def test_sleep_and_wake_after_every_step_trains_bit_identically_on_one_process(tmp_path):
    slept = _run(job_config(str(tmp_path), name="slept", total_steps=3), sleep=True)
    _assert_same(slept, _run(job_config(str(tmp_path), name="awake", total_steps=3), sleep=False))


def _both(save_dir: str) -> tuple:
    mesh = {"data_parallel_shard": 2}
    slept = _run(job_config(save_dir, name="slept", total_steps=3, mesh=mesh), sleep=True)
    return slept, _run(job_config(save_dir, name="awake", total_steps=3, mesh=mesh), sleep=False)


def test_sleep_and_wake_after_every_step_trains_bit_identically_on_fsdp2(tmp_path):
    for slept, awake in run_distributed(_both, 2, str(tmp_path), timeout=120):
        _assert_same(slept, awake)


def test_waking_a_trainer_that_is_not_asleep_is_refused(tmp_path):
    with Trainer.from_config(job_config(str(tmp_path), total_steps=1)) as trainer:
        with pytest.raises(Exception, match="not asleep") as info:
            trainer.wake()
        assert "\n" not in str(info.value)
        trainer.sleep()
        with pytest.raises(Exception, match="asleep already"):
            trainer.sleep()
        trainer.wake()
        assert trainer.train().final_step == 1
