"""Sleep and wake of the training state (`TrainingStateSleep`): while asleep no storage of a parameter,
gradient or optimizer state keeps its bytes (nor any FSDP2 unsharded parameter); after wake every tensor
is the same object with the same placements and bytes, and training with a sleep/wake cycle in every
step equals training without one bit for bit, on one process, FSDP 2, TP 2 and FSDP 2 x TP 2 (forked
gloo ranks)."""

import numpy as np
import pytest
import torch
from _tiny_transformer import TinyConfig, make_model, tiny_plan
from _train_compare import SEQ, parallel_run, reference_run
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from d9d.mesh import MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    SleepError,
    TrainingStateSleep,
    parallelize_fsdp,
    parallelize_tensor_parallel,
)
from d9d.parallel.sleep import training_devices


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every training-state tensor object by a name: parameters, gradients, optimizer states."""
    named = {}
    for name, param in model.named_parameters():
        named[name] = param
        if param.grad is not None:
            named[f"{name}.grad"] = param.grad
        for key, value in opt.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                named[f"{name}.{key}"] = value
    return named


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _layout(t: torch.Tensor) -> object:
    return (t.device_mesh, t.placements) if isinstance(t, DTensor) else None


def _fsdp_leftovers(model: nn.Module) -> int:
    """Bytes of FSDP2's unsharded parameters plus the count of pending all-gather results."""
    left = 0
    for module in model.modules():
        group = fully_shard.state(module)._fsdp_param_group if isinstance(module, FSDPModule) else None
        if group is None:
            continue
        left += int(group._all_gather_result is not None)
        for fsdp_param in group.fsdp_params:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            left += 0 if unsharded is None else _local(unsharded).untyped_storage().nbytes()
    return left


def _sleep_cycle(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """A forward without backward (FSDP2's root then keeps its unsharded parameters), sleep, check, wake,
    check; called with this step's gradients and the previous steps' optimizer states."""
    before = _state(model, opt)  # before the forward: FSDP2 then registers the unsharded parameters
    values = {k: _local(v).detach().clone() for k, v in before.items()}
    layouts = {k: _layout(v) for k, v in before.items()}
    with torch.no_grad():
        storages = [_local(v).untyped_storage() for v in before.values()]
    # FSDP2's sharded gradients are views into one reduce-scatter output per unit
    held = sum({s.data_ptr(): s.nbytes() for s in storages}.values())
    sleep = TrainingStateSleep(model, opt)
    assert sleep.device_bytes() == held > 0
    with torch.no_grad():
        model(torch.zeros(2, SEQ, dtype=torch.long))
    assert sleep.device_bytes() >= held  # with FSDP2's unsharded root parameters now
    moved = sleep.sleep()
    assert sleep.asleep and moved == held and sleep.device_bytes() == 0
    assert all(s.nbytes() == 0 for s in storages)  # every storage that held training state is freed
    assert _fsdp_leftovers(model) == 0
    sleep.wake()
    after = _state(model, opt)
    assert after.keys() == before.keys() and all(after[k] is v for k, v in before.items())
    assert all(_layout(v) == layouts[k] for k, v in after.items())
    assert all(torch.equal(_local(v), values[k]) for k, v in after.items())
    assert not sleep.asleep and sleep.device_bytes() == moved


def _assert_identical(got, want) -> None:
    assert got.losses == want.losses and got.grad_norms == want.grad_norms
    assert got.params.keys() == want.params.keys()
    assert all(torch.equal(got.params[k], v) for k, v in want.params.items())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_one_process_training_with_sleep_and_wake_in_every_step_is_bit_identical(tied):
    cfg = TinyConfig(tie_embeddings=tied)
    _assert_identical(reference_run(cfg=cfg, between=_sleep_cycle), reference_run(cfg=cfg))


def _fsdp(model, ctx):
    parallelize_fsdp(model, ctx.mesh("dense"), blocks=list(model.blocks))


def _tp(model, ctx):
    parallelize_tensor_parallel(model, ctx.mesh("dense"), tiny_plan())


def _tp_fsdp(model, ctx):
    _tp(model, ctx)
    _fsdp(model, ctx)


@pytest.mark.parametrize(
    ("config", "parallelize"),
    [
        (MeshConfig(data_parallel_shard=2), _fsdp),
        (MeshConfig(tensor_parallel=2), _tp),
        (MeshConfig(data_parallel_shard=2, tensor_parallel=2), _tp_fsdp),
    ],
    ids=["fsdp2", "tp2", "fsdp2xtp2"],
)
def test_parallel_training_with_sleep_and_wake_in_every_step_is_bit_identical(config, parallelize):
    world = config.world_size
    slept = run_distributed(parallel_run, world, config, parallelize, between=_sleep_cycle)[0]
    awake = run_distributed(parallel_run, world, config, parallelize)[0]
    _assert_identical(slept, awake)


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.zeros(2, SEQ, dtype=torch.long)).sum().backward()
    opt.step()
    return model, opt


def _one_line(call) -> str:
    with pytest.raises(SleepError) as info:
        call()
    assert "\n" not in str(info.value)
    return str(info.value)


def test_out_of_order_calls_and_a_forward_or_step_while_asleep_are_refused_in_one_line():
    model, opt = _trained()
    sleep = TrainingStateSleep(model, opt)
    assert "not asleep" in _one_line(sleep.wake)
    sleep.sleep()
    assert "asleep already" in _one_line(sleep.sleep)
    assert "wake()" in _one_line(lambda: model(torch.zeros(1, SEQ, dtype=torch.long)))
    assert "wake()" in _one_line(opt.step)
    sleep.wake()
    model(torch.zeros(1, SEQ, dtype=torch.long))  # the guards are gone
    opt.step()


def test_a_storage_that_cannot_be_freed_is_named_with_the_fix():
    model = nn.Linear(3, 1, bias=False)
    model.weight = nn.Parameter(torch.from_numpy(np.zeros((1, 3), dtype=np.float32)))
    message = _one_line(TrainingStateSleep(model).sleep)
    assert "(1, 3)" in message and ".clone()" in message


def test_sleep_frees_the_accelerators_and_leaves_host_state_beside_them():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert training_devices([cpu, cuda, cpu]) == {cuda}  # AdamW's step counters stay on the host
    assert training_devices([cpu, cpu]) == {cpu}  # a CPU run: its state is the CPU's
    assert training_devices([]) == set()
