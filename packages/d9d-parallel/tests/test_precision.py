"""Mixed precision: bf16 matmuls, fp32 master weights and gradient reductions, on one process and FSDP 2."""

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _tiny_transformer import make_batches, make_model
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    MixedPrecision,
    ParallelizeError,
    PrecisionConfig,
    autocast_forward,
    enable_tf32,
    parallelize_fsdp,
    parallelize_hsdp,
    parallelize_replicate,
    precision_autocast,
    resolve_precision,
)

BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
FP32 = MixedPrecision()

_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "linear", "matmul")


class _Recorder(TorchDispatchMode):
    """Records the floating input dtypes of matmul-like ops and of collectives, and whether in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.matmuls: list[tuple[str, tuple[torch.dtype, ...], bool]] = []
        self.collectives: list[tuple[str, tuple[torch.dtype, ...], bool]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        dtypes = tuple(t.dtype for t in _tensors(args) + _tensors(kwargs) if t.is_floating_point())
        in_backward = torch._C._current_graph_task_id() != -1
        if name in _MATMULS or "scaled_dot_product" in name:
            self.matmuls.append((name, dtypes, in_backward))
        elif func.namespace in ("c10d", "_c10d_functional"):
            self.collectives.append((name, dtypes, in_backward))
        return func(*args, **kwargs)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


# --- resolve_precision ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("param", "device", "want"),
    [
        ("auto", "cuda", torch.bfloat16),
        ("auto", torch.device("cuda", 3), torch.bfloat16),
        ("auto", "cpu", torch.float32),
        ("auto", "meta", torch.float32),
        ("bfloat16", "cpu", torch.bfloat16),
        ("bfloat16", "cuda", torch.bfloat16),
        ("float32", "cuda", torch.float32),
        ("float32", "cpu", torch.float32),
    ],
)
def test_resolve_precision_param_dtype(param, device, want):
    got = resolve_precision(PrecisionConfig(param_dtype=param), device)
    assert got.param_dtype == want
    assert got.reduce_dtype == torch.float32  # the default
    assert got.enabled == (want != torch.float32)


@pytest.mark.parametrize(("reduce", "want"), [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_resolve_precision_reduce_dtype(reduce, want):
    got = resolve_precision(PrecisionConfig(param_dtype="bfloat16", reduce_dtype=reduce), "cuda")
    assert got == MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=want)
    assert got.describe() == f"param bfloat16, reduce {reduce}"


def test_precision_config_defaults():
    config = PrecisionConfig()
    assert (config.param_dtype, config.reduce_dtype, config.tf32) == ("auto", "float32", True)


# --- precision_autocast and autocast_forward on one process -------------------------------------


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(8, 4)


def _record_linear(layer: nn.Module, context: Any) -> tuple[_Recorder, torch.Tensor]:
    x = torch.randn(3, 8)
    recorder = _Recorder()
    with recorder:
        with context:
            out = layer(x)
        out.float().sum().backward()
    return recorder, out


@pytest.mark.parametrize("precision", [None, FP32], ids=["none", "fp32"])
def test_precision_autocast_is_a_noop_for_fp32(precision):
    layer = _linear()
    recorder, out = _record_linear(layer, precision_autocast(precision, "cpu"))
    assert out.dtype == torch.float32
    forward = [dtypes for _, dtypes, bwd in recorder.matmuls if not bwd]
    assert forward and all(set(d) == {torch.float32} for d in forward), recorder.matmuls
    assert not torch.is_autocast_enabled("cpu")


def test_precision_autocast_bf16_matmul_with_fp32_parameter_and_grad_on_cpu():
    layer = _linear()
    recorder, out = _record_linear(layer, precision_autocast(BF16, "cpu"))
    assert out.dtype == torch.bfloat16
    forward = [(name, dtypes) for name, dtypes, bwd in recorder.matmuls if not bwd]
    backward = [(name, dtypes) for name, dtypes, bwd in recorder.matmuls if bwd]
    assert forward, recorder.matmuls
    assert all(set(dtypes) == {torch.bfloat16} for _, dtypes in forward), forward
    assert backward and all(set(dtypes) == {torch.bfloat16} for _, dtypes in backward), backward
    # autocast casts a compute copy; the parameter, and so its gradient, stay fp32
    for param in layer.parameters():
        assert param.dtype == torch.float32
        assert param.grad is not None and param.grad.dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")  # the context did not leak


def test_precision_autocast_close_to_fp32_within_bf16_tolerance():
    layer = _linear()
    x = torch.randn(3, 8)
    with precision_autocast(BF16, "cpu"):
        low = layer(x)
    torch.testing.assert_close(low.float(), layer(x), rtol=2e-2, atol=2e-2)


def test_autocast_forward_wraps_in_place_idempotent_and_keeps_keys():
    model = make_model()
    keys = list(model.state_dict())
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    autocast_forward(model, BF16, "cpu")
    wrapped = model.forward
    autocast_forward(model, BF16, "cpu")  # a second call changes nothing
    assert model.forward is wrapped
    assert list(model.state_dict()) == keys
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    tokens = make_batches(1, 2, 8)[0]
    recorder = _Recorder()
    with recorder:
        logits = model(tokens[:, :-1])  # a plain call: no context in the caller
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert logits.dtype == torch.bfloat16
    forward = [(name, dtypes) for name, dtypes, _ in recorder.matmuls]
    assert forward
    for name, dtypes in forward:
        checked = dtypes[:3] if "scaled_dot_product" in name else dtypes
        assert set(checked) == {torch.bfloat16}, (name, dtypes)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("precision", [None, FP32], ids=["none", "fp32"])
def test_autocast_forward_is_a_noop_for_fp32(precision):
    model = make_model()
    autocast_forward(model, precision, "cpu")
    assert "forward" not in vars(model)
    assert model(make_batches(1, 2, 8)[0][:, :-1]).dtype == torch.float32


# --- the parallelize functions on one process --------------------------------------------------


_PARALLELIZE = {"hsdp": parallelize_hsdp, "fsdp": parallelize_fsdp, "replicate": parallelize_replicate}


@pytest.mark.parametrize("name", list(_PARALLELIZE))
def test_parallelize_without_a_mesh_returns_the_module_unchanged(name):
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = _PARALLELIZE[name](model, None, blocks=list(model.blocks), precision=BF16)
    assert got is model
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", list(_PARALLELIZE))
@pytest.mark.parametrize(
    "dtypes",
    [{"param_dtype": torch.bfloat16}, {"reduce_dtype": torch.float32}],
    ids=["param_dtype", "reduce_dtype"],
)
def test_precision_and_explicit_dtypes_are_refused_together(name, dtypes):
    with pytest.raises(ParallelizeError, match=r"either precision= or param_dtype=/reduce_dtype=") as err:
        _PARALLELIZE[name](make_model(), None, precision=BF16, **dtypes)
    assert name in str(err.value)


# --- FSDP 2 with precision: bf16 gathers, fp32 reduce-scatter -----------------------------------


def _fsdp2_bf16_step() -> dict[str, Any]:
    with DistributedContext.from_env(MeshConfig(data_parallel_shard=2)) as ctx:
        model = make_model()
        parallelize_fsdp(model, ctx.mesh("dense"), blocks=list(model.blocks), precision=BF16)
        tokens = make_batches(1, 4, 8)[0]
        rows = tokens[ctx.rank * 2 : (ctx.rank + 1) * 2]
        recorder = _Recorder()
        with recorder:
            logits = model(rows[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten(), reduction="sum") / (
                tokens[:, 1:].numel()
            )
            loss.backward()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        return {
            "loss": float(total),
            "full_grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
            "matmuls": recorder.matmuls,
            "collectives": recorder.collectives,
            "logits": logits.dtype,
            "params": sorted({str(p.dtype) for p in model.parameters()}),
            "param_types": sorted({type(p).__name__ for p in model.parameters()}),
            "grads": sorted({str(p.grad.dtype) for p in model.parameters()}),
            "grad_types": sorted({type(p.grad).__name__ for p in model.parameters()}),
        }


def test_fsdp2_precision_gathers_bf16_and_reduce_scatters_fp32():
    for rank, seen in enumerate(run_distributed(_fsdp2_bf16_step, 2)):
        assert seen["logits"] == torch.bfloat16
        forward = [(n, d) for n, d, bwd in seen["matmuls"] if not bwd]
        backward = [(n, d) for n, d, bwd in seen["matmuls"] if bwd]
        assert forward and backward, (rank, seen["matmuls"])
        for name, dtypes in forward + backward:
            # sdpa's backward also takes its fp32 softmax statistics: the tensors it multiplies come first
            checked = dtypes[:3] if "scaled_dot_product" in name else dtypes
            assert set(checked) == {torch.bfloat16}, (rank, name, dtypes)
        gathers = [(n, d) for n, d, bwd in seen["collectives"] if "gather" in n]
        assert gathers, (rank, seen["collectives"])
        assert all(set(d) == {torch.bfloat16} for _, d in gathers), (rank, gathers)
        scatters = [(n, d, bwd) for n, d, bwd in seen["collectives"] if "reduce_scatter" in n]
        assert len(scatters) == 3, (rank, scatters)  # two blocks and the root
        assert all(bwd and set(d) == {torch.float32} for _, d, bwd in scatters), (rank, scatters)
        # master weights and their (sharded) gradients stay fp32 DTensors
        assert seen["params"] == ["torch.float32"] and seen["param_types"] == ["DTensor"]
        assert seen["grads"] == ["torch.float32"] and seen["grad_types"] == ["DTensor"]


def test_fsdp2_bf16_matches_one_process_autocast_within_bf16_tolerance():
    """The two mechanisms of one contract: FSDP2's bf16 gather and autocast on one process agree."""
    got = run_distributed(_fsdp2_bf16_step, 2)[0]
    model = make_model()
    tokens = make_batches(1, 4, 8)[0]
    with precision_autocast(BF16, "cpu"):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert got["loss"] == pytest.approx(float(loss.detach()), rel=1e-3)
    for name, param in model.named_parameters():
        error = (got["full_grads"][name] - param.grad).abs().max() / param.grad.abs().max()
        assert error < 5e-2, (name, float(error))  # bf16 rounding: measured <= 2e-2


def test_a_deepcopy_of_an_autocast_module_uses_its_own_weights():
    layer = _linear()
    autocast_forward(layer, BF16, "cpu")
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.zero_()
    assert torch.count_nonzero(twin(torch.randn(3, 8))) == 0


def test_enable_tf32_sets_and_clears_the_cuda_flags_and_every_getter_still_answers():
    # torch's legacy getters raise when the legacy and per-backend settings disagree; inductor calls them
    matmul, conv = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for enabled, precision, legacy in ((True, "tf32", "high"), (False, "ieee", "highest")):
            enable_tf32(enabled)
            assert torch.backends.cuda.matmul.fp32_precision == precision
            assert torch.get_float32_matmul_precision() == legacy
            assert torch.backends.cuda.matmul.allow_tf32 is enabled
            assert torch.backends.cudnn.allow_tf32 is enabled
        enable_tf32(True)
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = conv
