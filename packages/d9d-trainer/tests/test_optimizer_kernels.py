"""`optimizer.implementation`: which torch.optim kernels (fused, foreach, for-loop) for which parameters,
and the config keys of the GPU-grade step failing with one line that names their path."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _job import job_config

from d9d.mesh.testing import run_distributed
from d9d.trainer import BuiltinOptimizerProvider, ConfigError, Trainer
from d9d.trainer.builtins.optim import optimizer_kernels
from d9d.trainer.config.job import OptimizerConfig


def _plain(n: int = 3) -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(4, 2)) for _ in range(n)]


def _step(params: list[torch.Tensor], kernels: dict[str, bool]) -> None:
    """One AdamW step with those kernels, so the kwargs are known to work, not just returned."""
    opt = torch.optim.AdamW(params, lr=1e-2, **kernels)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()


# --- plain CPU parameters -----------------------------------------------------------------------


def test_auto_on_cpu_is_foreach():
    params = _plain()
    assert optimizer_kernels("auto", params) == {"foreach": True}
    _step(params, optimizer_kernels("auto", params))


@pytest.mark.parametrize(
    ("implementation", "want"),
    [("fused", {"fused": True}), ("foreach", {"foreach": True}), ("for_loop", {"foreach": False})],
)
def test_explicit_implementation(implementation, want):
    params = _plain()
    assert optimizer_kernels(implementation, params) == want
    before = [p.detach().clone() for p in params]
    _step(params, want)  # torch's fused AdamW runs on CPU too
    assert all(not torch.equal(p, b) for p, b in zip(params, before, strict=True))


def test_the_three_implementations_take_the_same_step():
    results = []
    for implementation in ("fused", "foreach", "for_loop"):
        params = _plain()
        _step(params, optimizer_kernels(implementation, params))
        results.append([p.detach() for p in params])
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_auto_on_cuda_is_fused():
    """All parameters on CUDA (fake tensors: no GPU needed to see the choice)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        on_cuda = [nn.Parameter(torch.empty(4, 2, device="cuda")) for _ in range(2)]
        on_cpu = nn.Parameter(torch.empty(4, 2))
    assert optimizer_kernels("auto", on_cuda) == {"fused": True}
    assert optimizer_kernels("auto", [*on_cuda, on_cpu]) == {"foreach": True}  # not all on CUDA


def test_auto_without_parameters():
    assert optimizer_kernels("auto", []) == {"foreach": True}


def test_builtin_provider_passes_the_choice_to_torch():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    for implementation, key, value in [
        ("auto", "foreach", True),
        ("fused", "fused", True),
        ("foreach", "foreach", True),
        ("for_loop", "foreach", False),
    ]:
        provider = BuiltinOptimizerProvider(OptimizerConfig(implementation=implementation))
        opt = provider.build_optimizer(model.named_parameters())
        assert opt.defaults[key] is value, implementation
    sgd = BuiltinOptimizerProvider(OptimizerConfig(name="sgd", implementation="for_loop"))
    assert sgd.build_optimizer(model.named_parameters()).defaults["foreach"] is False


# --- DTensor and plain parameters mixed (a parallelism applied to part of a model) ---------------


def _mixed_rank() -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))

    def dtensor() -> nn.Parameter:
        return nn.Parameter(distribute_tensor(torch.randn(4, 2), mesh, [Replicate()]))

    mixed = [dtensor(), *_plain(2)]
    seen: dict[str, object] = {
        "auto_mixed": optimizer_kernels("auto", mixed),
        "for_loop_mixed": optimizer_kernels("for_loop", mixed),
        "auto_all_dtensor": optimizer_kernels("auto", [dtensor(), dtensor()]),
        "foreach_all_dtensor": optimizer_kernels("foreach", [dtensor(), dtensor()]),
    }
    before = mixed[0].full_tensor().clone()
    _step(mixed, optimizer_kernels("auto", mixed))  # the fallback steps
    seen["auto_mixed_stepped"] = not torch.equal(mixed[0].full_tensor(), before)
    try:  # and the reason for it: torch's foreach kernels refuse the mix
        _step(mixed, {"foreach": True})
        seen["torch_foreach_mixed"] = "no error"
    except Exception as error:
        seen["torch_foreach_mixed"] = f"{type(error).__name__}: {error}"
    for implementation in ("fused", "foreach"):
        try:
            optimizer_kernels(implementation, mixed)
            seen[implementation] = None
        except ConfigError as error:
            seen[implementation] = str(error)
    return seen


@pytest.fixture(scope="module")
def mixed() -> dict[str, object]:
    return run_distributed(_mixed_rank, 1)[0]


def test_auto_with_mixed_parameters_falls_back_to_the_for_loop(mixed):
    assert mixed["auto_mixed"] == {"foreach": False}
    assert mixed["auto_mixed_stepped"]
    assert "mixed" in str(mixed["torch_foreach_mixed"]), mixed["torch_foreach_mixed"]
    assert mixed["for_loop_mixed"] == {"foreach": False}


def test_all_dtensor_parameters_keep_foreach(mixed):
    assert mixed["auto_all_dtensor"] == {"foreach": True}
    assert mixed["foreach_all_dtensor"] == {"foreach": True}


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_fused_or_foreach_with_mixed_parameters_is_one_clear_error(mixed, implementation):
    message = mixed[implementation]
    assert message is not None, f"{implementation} on mixed parameters raised nothing"
    assert "\n" not in message
    assert message.startswith(f"optimizer.implementation: {implementation} ")
    assert "mixes both" in message
    assert message.endswith("use optimizer.implementation: auto or for_loop")


# --- config keys of the GPU-grade step ----------------------------------------------------------


def _set(config: dict, path: str, value: object) -> dict:
    node = config
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return config


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (
            "trainer.precision.param_dtype",
            "float16",
            r"trainer\.precision\.param_dtype: Invalid enum value 'float16'; choose one of auto, bfloat16, float32",
        ),
        (
            "trainer.precision.reduce_dtype",
            "float64",
            r"trainer\.precision\.reduce_dtype: Invalid enum value 'float64'",
        ),
        ("trainer.precision.tf32", "yes", r"trainer\.precision\.tf32: Expected bool, got str"),
        (
            "trainer.activation_checkpointing.mode",
            "sometimes",
            r"trainer\.activation_checkpointing\.mode: Invalid enum value 'sometimes'; "
            r"choose one of none, full, selective, op$",
        ),
        (
            "trainer.activation_checkpointing.every",
            0,
            r"trainer\.activation_checkpointing\.every must be >= 1, got 0",
        ),
        ("trainer.compile.enabled", "yes", r"trainer\.compile\.enabled: Expected bool, got str"),
        ("trainer.compile.mode", "max", r"unknown key trainer\.compile\.mode; valid keys here: enabled"),
        (
            "trainer.device",
            "tpu",
            r"trainer\.device: Invalid enum value 'tpu'; choose one of auto, cuda, cpu",
        ),
        (
            "optimizer.implementation",
            "magic",
            r"optimizer\.implementation: Invalid enum value 'magic'; choose one of auto, fused, foreach, for_loop",
        ),
    ],
)
def test_bad_gpu_step_config_is_one_clear_error(tmp_path, path, value, message):
    config = _set(job_config(str(tmp_path)), path, value)
    with pytest.raises(ConfigError, match=message) as info:
        Trainer.from_config(config)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "tiny").exists()  # nothing written
