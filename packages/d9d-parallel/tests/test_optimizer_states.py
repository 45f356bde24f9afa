"""bfloat16 optimizer states (`StateDtypeAdamW`, `StateDtypeSGD`): half the bytes of float32 states,
counted from the tensors; each step is torch's own AdamW / SGD update given the stored states, with
only the states rounded to bfloat16 (to nearest) after it; the chunked upcast changes no bit and
never holds more than one chunk; DTensor parameters (FSDP2, tensor parallelism on 2 forked ranks)
update their shards exactly as one process updates the full tensors; a state dict loads across the
state dtype both ways."""

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _tiny_transformer import make_batches, make_model, tiny_plan
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    StateDtypeAdamW,
    StateDtypeSGD,
    optimizer_state_bytes,
    parallelize_fsdp,
    parallelize_tensor_parallel,
)

LR = 1e-2


def _backward(model: nn.Module, step: int) -> None:
    tokens = make_batches(step + 1, 4, 8)[step]
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        optimizer.zero_grad()
        _backward(model, step)
        optimizer.step()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_bfloat16_states_take_exactly_half_the_bytes_of_float32_states():
    numel = sum(p.numel() for p in make_model().parameters())
    found = {}
    for name, build in {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=LR),
        "adamw_bf16": lambda ps: StateDtypeAdamW(ps, lr=LR),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),
        "sgd_bf16": lambda ps: StateDtypeSGD(ps, lr=LR, momentum=0.9),
    }.items():
        model = make_model()
        optimizer = build(model.parameters())
        _steps(model, optimizer, 1)
        found[name] = optimizer_state_bytes(optimizer)
        states = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
        dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
        assert {t.dtype for t in states} == {dtype}, name
    assert found == {"adamw": 8 * numel, "adamw_bf16": 4 * numel, "sgd": 4 * numel, "sgd_bf16": 2 * numel}
    assert optimizer_state_bytes(StateDtypeSGD(make_model().parameters(), lr=LR)) == 0  # no momentum


def _torch_twin(kind: str, model: nn.Module, ours: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """torch's float32 optimizer over `model`, its state our stored state upcast (exactly)."""
    if kind == "adamw":
        twin: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    else:
        twin = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=0.1, nesterov=True)
    state = copy.deepcopy(ours.state_dict())
    for entry in state["state"].values():
        for key, value in entry.items():
            if key != "step":
                entry[key] = value.float()
    if state["state"]:
        twin.load_state_dict(state)
    return twin


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("foreach", [False, True])
def test_every_step_is_torchs_update_given_the_stored_states_rounded_to_nearest(kind, foreach):
    ours_model = make_model()
    if kind == "adamw":
        ours: torch.optim.Optimizer = StateDtypeAdamW(
            ours_model.parameters(), lr=LR, weight_decay=0.1, foreach=foreach
        )
    else:
        ours = StateDtypeSGD(
            ours_model.parameters(), lr=LR, momentum=0.9, weight_decay=0.1, nesterov=True, foreach=foreach
        )
    float32_model = make_model()
    float32 = _torch_twin(kind, float32_model, ours)
    for step in range(4):
        twin_model = copy.deepcopy(ours_model)
        twin = _torch_twin(kind, twin_model, ours)  # torch's update from our states, in float32
        for model, optimizer in ((ours_model, ours), (twin_model, twin), (float32_model, float32)):
            optimizer.zero_grad()
            _backward(model, step)
            optimizer.step()
        for (name, p), q in zip(ours_model.named_parameters(), twin_model.parameters(), strict=True):
            assert torch.equal(p, q), (step, name)  # the update itself: torch's, bit for bit
            for key, value in ours.state[p].items():
                expected = twin.state[q][key]
                if key == "step":
                    assert torch.equal(value, expected)
                else:  # the stored state: torch's float32 state rounded to nearest bfloat16
                    assert value.dtype == torch.bfloat16 and torch.equal(value, expected.to(torch.bfloat16))
    # against float32 states all along: only the rounding differs, a bfloat16 ulp's worth per step
    for (name, p), q in zip(ours_model.named_parameters(), float32_model.parameters(), strict=True):
        moved = (q - make_model().get_parameter(name)).abs().max()
        assert 0 < (p - q).abs().max() < 0.05 * moved, name


class _Upcasts(TorchDispatchMode):
    """The sizes of every bfloat16 -> float32 copy (the optimizer's upcast of a state chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and (args[0].dtype, kwargs.get("dtype")) == (
            torch.bfloat16,
            torch.float32,
        ):
            self.sizes.append(args[0].numel())
        return func(*args, **kwargs)


@pytest.mark.parametrize("foreach", [False, True])
def test_chunks_change_no_bit_and_each_upcasts_at_most_chunk_elements(foreach):
    numel = sum(p.numel() for p in make_model().parameters())
    sizes = sorted({p.numel() for p in make_model().parameters()})
    largest = sizes[-1]
    # below, at and above the smallest tensor; one below, at and above the largest; all at once
    chunks = [sizes[0] - 1, sizes[0], sizes[0] + 1, largest - 1, largest, largest + 1, 2**25]
    results = []
    for chunk in chunks:
        model = make_model()
        optimizer = StateDtypeAdamW(model.parameters(), lr=LR, chunk_elements=chunk, foreach=foreach)
        _steps(model, optimizer, 1)  # creates the states (zeros: no upcast of them is needed)
        optimizer.zero_grad()
        _backward(model, 1)
        with _Upcasts() as upcasts:
            optimizer.step()
        assert max(upcasts.sizes) <= chunk and sum(upcasts.sizes) == 2 * numel, (chunk, upcasts.sizes[:8])
        states = {f"{i}.{k}": v.clone() for i, s in enumerate(optimizer.state.values()) for k, v in s.items()}
        results.append((_params(model), states))
    for params, states in results[:-1]:
        assert all(torch.equal(params[n], results[-1][0][n]) for n in params)
        assert all(torch.equal(states[k], results[-1][1][k]) for k in states)
    _one_element_at_a_time(foreach)


def _one_element_at_a_time(foreach: bool) -> None:
    """Two steps with chunks of one element equal two steps of the whole tensors."""
    model = nn.Linear(3, 2)
    whole = copy.deepcopy(model)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    for m, chunk in ((model, 1), (whole, 2**25)):
        optimizer = StateDtypeAdamW(m.parameters(), lr=LR, chunk_elements=chunk, foreach=foreach)
        for _ in range(2):
            optimizer.zero_grad()
            m(x).square().sum().backward()
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), whole.parameters(), strict=True))


def test_a_state_dict_loads_across_the_state_dtype_both_ways():
    float32_model, bf16_model = make_model(), make_model()
    float32 = torch.optim.AdamW(float32_model.parameters(), lr=LR)
    bf16 = StateDtypeAdamW(bf16_model.parameters(), lr=LR)
    _steps(float32_model, float32, 2)
    _steps(bf16_model, bf16, 2)
    model_a, model_b = make_model(), make_model()
    into_bf16 = StateDtypeAdamW(model_a.parameters(), lr=LR)
    into_bf16.load_state_dict(float32.state_dict())  # torch casts to the parameter's dtype; ours back
    into_float32 = torch.optim.AdamW(model_b.parameters(), lr=LR)
    into_float32.load_state_dict(bf16.state_dict())
    pairs = zip(model_a.parameters(), float32_model.parameters(), model_b.parameters(), bf16_model.parameters(),
                strict=True)  # fmt: skip
    for a, source_a, b, source_b in pairs:
        for key in ("exp_avg", "exp_avg_sq"):
            loaded, saved = into_bf16.state[a][key], float32.state[source_a][key]
            assert loaded.dtype == torch.bfloat16 and torch.equal(loaded, saved.bfloat16())  # to nearest
            loaded, saved = into_float32.state[b][key], bf16.state[source_b][key]
            assert loaded.dtype == torch.float32 and torch.equal(loaded, saved.float())  # exactly
    # and both go on training from there
    _steps(model_a, into_bf16, 1)
    assert {v.dtype for s in into_bf16.state.values() for k, v in s.items() if k != "step"} == {
        torch.bfloat16
    }


def _dtensor_steps(layout: str) -> dict[str, Any]:
    """FSDP 2 or TP 2: bfloat16-state AdamW on DTensors (small chunks) against one process's on the
    full tensors with the same (full) gradients. The gradients are drawn, not computed: the forked
    ranks run no autograd (a parent that ran backward before the fork would make it refuse)."""
    config = MeshConfig(data_parallel_shard=2) if layout == "fsdp" else MeshConfig(tensor_parallel=2)
    with DistributedContext.from_env(config) as ctx:
        model, reference = make_model(), make_model()
        if layout == "fsdp":
            parallelize_fsdp(model, ctx.mesh("dense"), blocks=list(model.blocks))
        else:
            plan = tiny_plan(sequence_parallel=False, loss_parallel=False)
            parallelize_tensor_parallel(model, ctx.mesh("dense"), plan)
        sharded = StateDtypeAdamW(model.parameters(), lr=LR, weight_decay=0.1, chunk_elements=100)
        whole = StateDtypeAdamW(reference.parameters(), lr=LR, weight_decay=0.1)
        for step in range(3):
            sharded.zero_grad()
            drawn = torch.Generator().manual_seed(step)
            for p, r in zip(model.parameters(), reference.parameters(), strict=True):
                full = torch.randn(p.shape, generator=drawn)
                p.grad = distribute_tensor(full, p.device_mesh, p.placements)
                r.grad = full
            sharded.step()
            whole.step()
        states = {}
        for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
            for key in ("exp_avg", "exp_avg_sq"):
                value = sharded.state[p][key]
                assert isinstance(value, DTensor) and value.placements == p.placements, (name, key)
                states[f"{name}.{key}"] = (value.full_tensor(), whole.state[r][key])
        local_param_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
        return {
            "params": {n: (p.full_tensor(), reference.get_parameter(n).detach()) for n, p in model.named_parameters()},
            "states": states,
            "state_bytes": optimizer_state_bytes(sharded),
            "local_param_bytes": local_param_bytes,
        }  # fmt: skip


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_dtensor_parameters_update_their_shards_as_one_process_updates_the_whole(layout):
    for rank in run_distributed(_dtensor_steps, 2, layout):
        for name, (got, want) in {**rank["params"], **rank["states"]}.items():
            assert torch.equal(got, want), name
        assert {want.dtype for _, want in rank["states"].values()} == {torch.bfloat16}
        assert rank["state_bytes"] == rank["local_param_bytes"]  # 2 states x 2 bytes = 4 bytes a param


def test_bad_arguments_are_refused():
    params = make_model().parameters()
    with pytest.raises(ValueError, match="state_dtype must be a floating-point dtype"):
        StateDtypeAdamW(params, state_dtype=torch.int8)
    with pytest.raises(ValueError, match="chunk_elements must be >= 1"):
        StateDtypeSGD(make_model().parameters(), chunk_elements=0)
