"""The MoE balancing losses (auxiliary and router z-loss) in the trainer's step weigh like the task's loss
whatever the number of microbatches: the reference model with both on, its step run on hand-made
microbatches of the same global batch (one process, float32), compared by the gradients it leaves.

The chosen meaning (`d9d.parallel.expert.balancing`): a step adds the mean over its microbatches of each
microbatch's balancing losses. So two microbatches of identical data give the gradients of one
microbatch of that data; two of distinct data x and y give the mean of the gradients of [x; x] and
[y; y] alone (their token counts equal); the z-loss, a mean over tokens, gives the same for any split.
"""

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _job import job_config

from d9d.trainer import Trainer

VOCAB, SEQ = 64, 8
#: float32 on one process: the same sums in another order (measured: 3e-8 apart at most; a wrong
#: weighting of the balancing terms moves the router gradients by ~5e-2)
RTOL, ATOL = 1e-5, 1e-7


def _grads(save_dir: Path, name: str, microbatches: list[dict[str, torch.Tensor]], balancing: dict) -> dict:
    """The gradients one step of the MoE reference model leaves after `microbatches` (one global batch)."""
    model = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "moe": {"num_experts": 4, "top_k": 2, "moe_intermediate_size": 32, "balancing": balancing},
    }
    config = job_config(str(save_dir), name=name, total_steps=1, model=model)
    config["providers"]["model"] = "d9d.trainer:ReferenceModelProvider"
    config["trainer"]["gradient_clipping"] = {"max_norm": None}
    with Trainer.from_config(config) as trainer:
        output = trainer.train_step.run(microbatches, 1)
        assert output.applied
        return {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def _rows(seed: int, rows: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def _batch(*parts: torch.Tensor) -> dict[str, torch.Tensor]:
    tokens = torch.cat(parts)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def _assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual.keys() == expected.keys() and any(".router." in k for k in expected)
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, rtol=RTOL, atol=ATOL, msg=name)


BOTH = {"aux_loss_coef": 1.0, "z_loss_coef": 0.1}


def test_two_microbatches_of_identical_data_give_the_gradients_of_one(tmp_path):
    x = _rows(0)
    one = _grads(tmp_path, "one", [_batch(x, x)], BOTH)
    two = _grads(tmp_path, "two", [_batch(x), _batch(x)], BOTH)
    _assert_same(two, one)
    plain = _grads(tmp_path, "plain", [_batch(x, x)], {})
    router = next(k for k in one if ".router." in k)
    assert not torch.allclose(one[router], plain[router], rtol=1e-3)  # the balancing terms count


def test_the_step_adds_the_mean_of_each_microbatchs_balancing_losses(tmp_path):
    x, y = _rows(0), _rows(1)
    two = _grads(tmp_path, "two", [_batch(x), _batch(y)], BOTH)
    only_x = _grads(tmp_path, "x", [_batch(x, x)], BOTH)
    only_y = _grads(tmp_path, "y", [_batch(y, y)], BOTH)
    _assert_same(two, {k: (only_x[k] + only_y[k]) / 2 for k in only_x})
    # the auxiliary loss is not linear in the tokens: one microbatch of x and y together differs
    together = _grads(tmp_path, "together", [_batch(x, y)], BOTH)
    router = next(k for k in two if ".router." in k)
    assert not torch.allclose(together[router], two[router], rtol=1e-3)


@pytest.mark.parametrize("split", [[2, 2], [1, 1, 1, 1]], ids=["2 microbatches", "4 microbatches"])
def test_the_z_loss_is_the_same_for_any_split_of_the_global_batch(tmp_path, split):
    rows = _rows(2, rows=4)
    one = _grads(tmp_path, "one", [_batch(rows)], {"z_loss_coef": 0.1})
    parts = [_batch(part) for part in rows.split(split)]
    _assert_same(_grads(tmp_path, "split", parts, {"z_loss_coef": 0.1}), one)
