"""Float8 linears through torchao: which linears convert (and which stay, with why), three float8
matmuls (`aten::_scaled_mm`, which torch runs on the CPU with tensorwise and rowwise scales) per
converted linear and step, the float32 weights kept under the same names, FSDP2's float8 all-gather
of tensorwise weights equal to one process, and the refusals.

The tests that need torchao skip without it (the torch-compat environment has no float8 extra);
the refusal of a missing torchao runs everywhere."""

import importlib.util
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _tiny_transformer import make_batches, make_model
from torch import nn
from torch.profiler import profile
from torch.utils._python_dispatch import TorchDispatchMode

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    Float8Config,
    ParallelizeError,
    apply_float8,
    float8_linears,
    parallelize_fsdp,
    select_float8_linears,
)

needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None,
    reason="torchao (d9d-parallel's float8 extra) is not installed",
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(64, 128, bias=False)
        self.gate = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)
        self.head = nn.Linear(64, 50)  # 50: not a multiple of 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(F.silu(self.gate(x)) * self.up(x)))


def _scaled_mms(model: nn.Module, x: torch.Tensor) -> int:
    """`aten::_scaled_mm` calls in one forward and backward, from the profiler (it sees the calls the
    float8 tensor subclass makes inside its own dispatch, which a dispatch mode does not)."""
    with profile() as prof:
        model(x).sum().backward()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_mm")


def test_the_selection_converts_matching_linears_and_names_those_float8_cannot_take():
    every = select_float8_linears(Net(), Float8Config())
    assert every.converted == ("up", "gate", "down")
    assert every.skipped == (("head", "50 not a multiple of 16"),)
    assert every.describe() == "tensorwise: 3 linears (up, gate, down); kept: head (50 not a multiple of 16)"
    some = select_float8_linears(Net(), Float8Config(recipe="rowwise", modules="up|down"))
    assert some.converted == ("up", "down") and not some.skipped  # the whole path must match


class _Decoder(nn.Module):
    """Two layers of one projection and an output layer of float8-able widths, named `lm_head`."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"q_proj": nn.Linear(64, 64)}) for _ in range(2)])
        self.lm_head = nn.Linear(64, 128, bias=False)


class _Renamed(nn.Module):
    """An output layer found by the Hugging Face accessor, not by its name."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.out = nn.Linear(64, 128)

    def get_output_embeddings(self) -> nn.Module:
        return self.out


def test_the_output_layer_stays_in_high_precision_unless_the_pattern_spells_its_name():
    default = select_float8_linears(_Decoder(), Float8Config())
    assert default.converted == ("layers.0.q_proj", "layers.1.q_proj")
    assert default.describe() == "tensorwise: 2 linears (layers.*.q_proj ×2); kept: lm_head (output layer)"
    with pytest.raises(
        ParallelizeError,
        match=r"keeps every one '\.\*head' matches \(e\.g\. lm_head: output layer; "
        r"modules must spell its name, e\.g\. 'lm_head', to convert it\)",
    ):
        select_float8_linears(_Decoder(), Float8Config(modules=".*head"))  # a wildcard does not name it
    named = select_float8_linears(_Decoder(), Float8Config(modules=".*_proj|lm_head"))
    assert named.converted == ("layers.0.q_proj", "layers.1.q_proj", "lm_head") and not named.skipped
    assert select_float8_linears(_Renamed(), Float8Config()).skipped == (("out", "output layer"),)
    assert select_float8_linears(_Renamed(), Float8Config(modules="proj|out")).converted == ("proj", "out")


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_each_converted_linear_runs_three_float8_matmuls_a_step_and_keeps_its_float32_weights(recipe):
    plain, model = Net(), Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    selection = apply_float8(model, Float8Config(recipe=recipe))
    assert float8_linears(model) == list(selection.converted) == ["up", "gate", "down"]
    state = model.state_dict()
    assert state.keys() == before.keys()  # checkpoints and exports see the same names ...
    assert all(
        v.dtype == torch.float32 and torch.equal(v, before[k]) for k, v in state.items()
    )  # ... and values
    x = torch.randn(32, 64)
    assert _scaled_mms(model, x) == 3 * 3  # forward, grad of the input, grad of the weight
    assert _scaled_mms(plain, x) == 0
    out, ref = model(x), plain(x)
    assert F.cosine_similarity(out.flatten(), ref.flatten(), dim=0) > 0.999  # float8 rounding only
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in model.parameters())


def test_refusals_name_the_key_and_the_fix(monkeypatch):
    with pytest.raises(
        ParallelizeError, match=r"modules='attn\.\*' matches no nn.Linear .*its linears: up, gate"
    ):
        select_float8_linears(Net(), Float8Config(modules="attn.*"))
    with pytest.raises(ParallelizeError, match=r"would convert no linear: .*head: 50 not a multiple of 16"):
        select_float8_linears(Net(), Float8Config(modules="head"))
    with pytest.raises(ValueError, match=r"trainer.precision.float8.modules is not a valid regex"):
        Float8Config(modules="(up")
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as if the float8 extra were not installed
    with pytest.raises(ParallelizeError, match=r"needs torchao, d9d-parallel's float8 extra: uv pip install"):
        apply_float8(Net(), Float8Config())


class _Gathers(TorchDispatchMode):
    """Bytes FSDP2 copies into its all-gather buffers (`fsdp.all_gather_copy_in`: each shard as it is
    gathered, viewed as bytes when a unit mixes dtypes), recorded, then run as they are."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "fsdp" and "all_gather_copy_in" in func._overloadpacket.__name__:
            self.bytes += sum(t.numel() * t.element_size() for t in _flat(args[0]))
        return func(*args, **(kwargs or {}))


def _flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    return []


def _loss_and_grads(model: nn.Module, rows: torch.Tensor, total: int) -> torch.Tensor:
    logits = model(rows[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum") / total
    loss.backward()
    return loss.detach()


def _fsdp2_float8_step() -> dict[str, Any]:
    with DistributedContext.from_env(MeshConfig(data_parallel_shard=2)) as ctx:
        tokens = make_batches(1, 4, 8)[0]
        rows = tokens[ctx.rank * 2 : (ctx.rank + 1) * 2]
        gathered = {}
        for in_float8 in (False, True):  # one forward: every unit is gathered once
            model = make_model()
            apply_float8(model, Float8Config(), fsdp_float8_all_gather=in_float8)
            parallelize_fsdp(model, ctx.mesh("dense"), blocks=list(model.blocks))
            with _Gathers() as gathers, torch.no_grad():
                model(rows[:, :-1])
            gathered[in_float8] = gathers.bytes
        loss = _loss_and_grads(model, rows, tokens[:, 1:].numel())
        torch.distributed.all_reduce(loss)
        return {
            "loss": float(loss),
            "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
            "gathered": gathered,
        }


@needs_torchao
def test_fsdp2_gathers_tensorwise_weights_in_float8_and_equals_one_process():
    got = run_distributed(_fsdp2_float8_step, 2)
    model = make_model()
    selection = apply_float8(model, Float8Config())
    tokens = make_batches(1, 4, 8)[0]
    # each rank's rows as one microbatch: float8 scales inputs by their own absolute maximum, so the
    # reference runs the same two halves (as the trainer's microbatches do)
    loss = sum(_loss_and_grads(model, tokens[i : i + 2], tokens[:, 1:].numel()) for i in (0, 2))
    params = sum(p.numel() for p in model.parameters()) // 2  # a rank's shard (every dim 0 is even)
    weights = sum(model.get_submodule(n).weight.numel() for n in selection.converted) // 2
    for rank in got:
        # float32 shards are 4 bytes an element; the converted weights' shards go as 1-byte float8
        assert rank["gathered"] == {False: 4 * params, True: 4 * params - 3 * weights}, rank["gathered"]
        assert rank["loss"] == pytest.approx(float(loss), rel=1e-5)
        for name, param in model.named_parameters():
            torch.testing.assert_close(rank["grads"][name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
