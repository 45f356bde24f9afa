"""Weights cast once per step (`weights_cast_once`): one copy per weight, the same numbers.

A tiny model of linears (with biases), a norm scale cast by its module (`cast_weight`) and an MoE
expert bank (`GroupedExperts`, which casts its stacked weights itself), under bf16 autocast on CPU; a
dispatch mode counts the `aten._to_copy` calls that change a parameter's dtype.
"""

import threading
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from d9d.parallel import cast_linears_once, cast_once_parameters, cast_weight, weights_cast_once
from d9d.parallel.expert import GroupedExperts

HIDDEN = 16


class _Casts(TorchDispatchMode):
    """Counts dtype-changing `_to_copy` calls on each parameter's storage, by name."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = {p.untyped_storage().data_ptr(): n for n, p in model.named_parameters()}
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket.__name__ == "_to_copy" and out.dtype != args[0].dtype:
            name = self.names.get(args[0].untyped_storage().data_ptr())
            if name is not None:
                self.counts[name] += 1
        return out


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
        self.scale = nn.Parameter(torch.rand(HIDDEN) + 0.5)
        self.experts = GroupedExperts(2, HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down(torch.relu(self.up(x)))
        counts = torch.tensor([x.shape[0] // 2, x.shape[0] - x.shape[0] // 2])
        return cast_weight(self.scale, x.dtype) * (x + self.experts(x, counts))


class _Model(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, HIDDEN)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(HIDDEN, 32)
        self.checkpointed = checkpointed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).to(torch.get_autocast_dtype("cpu"))  # the residual stream in bf16
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x)


def _train(microbatches: int, checkpointed: bool, once: bool, steps: int = 2) -> tuple[Counter[str], list]:
    """Steps of SGD over `microbatches` microbatches each, bf16 autocast forwards; the casts per
    parameter and the gradients of the last step."""
    torch.manual_seed(0)
    model = _Model(checkpointed)
    cast_linears_once(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 32, (steps, microbatches, 6))
    casts = _Casts(model)
    with casts:
        for step in range(steps):
            optimizer.zero_grad()
            with weights_cast_once(once):
                for batch in ids[step]:
                    with torch.autocast("cpu", torch.bfloat16):
                        loss = model(batch).float().logsumexp(-1).sum()
                    loss.backward()
            optimizer.step()
    return casts.counts, [p.grad.clone() for p in model.parameters()]


CAST = {"blocks.0.up.weight", "blocks.0.up.bias", "blocks.0.down.weight", "blocks.0.scale",
        "blocks.0.experts.w_gate", "blocks.0.experts.w_up", "blocks.0.experts.w_down",
        "head.weight", "head.bias"}  # fmt: skip
CAST |= {name.replace("blocks.0", "blocks.1") for name in CAST}


@pytest.mark.parametrize("checkpointed", [False, True], ids=["no_ac", "full_ac"])
@pytest.mark.parametrize("microbatches", [1, 4])
def test_each_weight_is_cast_once_per_step_whatever_the_microbatches_and_recompute(
    microbatches, checkpointed
):
    counts, _ = _train(microbatches, checkpointed, once=True)
    assert counts == dict.fromkeys(CAST, 2)  # two steps; the embedding table is never cast


def test_the_gradients_are_those_of_casting_in_every_forward_bit_for_bit():
    every, grads_every = _train(4, True, once=False)
    once, grads_once = _train(4, True, once=True)
    assert every["blocks.0.up.weight"] == 2 * 4 * 2  # per microbatch, forward and recompute
    assert every["head.weight"] == 2 * 4  # outside the checkpointed blocks: per microbatch
    assert sum(once.values()) == len(CAST) * 2
    assert all(torch.equal(a, b) for a, b in zip(grads_every, grads_once, strict=True))


def test_a_weight_changed_in_place_inside_the_scope_is_cast_again():
    weight = nn.Parameter(torch.ones(3))
    with weights_cast_once() as scope:
        assert scope is not None
        first = cast_weight(weight, torch.bfloat16)
        assert cast_weight(weight, torch.bfloat16) is first
        with torch.no_grad():
            weight.mul_(2)
        again = cast_weight(weight, torch.bfloat16)
        assert again is not first and again.tolist() == [2.0, 2.0, 2.0]
        assert scope.casts == 2 and scope.bytes == 3 * 2


def test_a_copy_made_without_grad_is_made_again_when_a_gradient_is_needed():
    weight = nn.Parameter(torch.ones(3))
    with weights_cast_once():
        with torch.no_grad():
            plain = cast_weight(weight, torch.bfloat16)
        tracked = cast_weight(weight, torch.bfloat16)
        assert not plain.requires_grad and tracked.requires_grad
        tracked.float().sum().backward()
    assert weight.grad is not None and weight.grad.tolist() == [1.0, 1.0, 1.0]


def test_outside_a_scope_a_weight_is_cast_at_every_use():
    weight = nn.Parameter(torch.ones(3))
    assert cast_weight(weight, torch.bfloat16) is not cast_weight(weight, torch.bfloat16)
    assert cast_weight(weight, torch.float32) is weight  # already the dtype: no copy
    linear = nn.Linear(3, 3)
    cast_linears_once(linear)
    with weights_cast_once(), torch.autocast("cpu", torch.bfloat16, enabled=False):
        linear(torch.ones(1, 3))  # no autocast: the linear computes in float32 from its own weight
    assert linear.weight.dtype == torch.float32 and isinstance(linear.weight, nn.Parameter)


class _OwnForward(nn.Linear):
    """A linear that computes from its float32 weight itself (as a float8 linear does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def test_linears_with_a_forward_of_their_own_and_embedding_tables_keep_float32():
    model = nn.Sequential(nn.Embedding(8, 4), nn.Embedding(8, 4), nn.Linear(4, 4), _OwnForward(4, 4))
    tied = nn.Linear(4, 8, bias=False)
    tied.weight = model[1].weight  # a head sharing the second table: computed from a copy
    model.append(tied)
    assert cast_linears_once(model) == 2
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in cast_once_parameters(model)) == ["1.weight", "2.bias", "2.weight"]


def test_the_scope_is_the_same_in_every_thread():
    """On CUDA an activation-checkpoint recompute runs in autograd's device thread: it must find the copies."""
    weight = nn.Parameter(torch.ones(3))
    found: list[torch.Tensor] = []
    with weights_cast_once():
        first = cast_weight(weight, torch.bfloat16)
        thread = threading.Thread(target=lambda: found.append(cast_weight(weight, torch.bfloat16)))
        thread.start()
        thread.join()
    assert found[0] is first
