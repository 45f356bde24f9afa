"""Mixed precision for any mesh: bf16 compute, fp32 master weights, optimizer state and reductions.

Two mechanisms, one numerics contract ("matmuls in `param_dtype`, master weights fp32"):

- FSDP2 units (`parallelize_hsdp/fsdp/replicate(..., precision=...)`) gather their parameters in
  `param_dtype` and reduce gradients in `reduce_dtype`: half the all-gather traffic and memory.
- Everything else (one process, tensor- or pipeline-only meshes, expert weights that FSDP ignores)
  runs under `torch.autocast(param_dtype)` (`precision_autocast`), which casts the compute copy of each
  matmul's inputs and leaves the fp32 parameter (and so its gradient and optimizer state) alone.

A training loop wraps its forward in `precision_autocast` on every mesh; inside FSDP2 units the
parameters already are `param_dtype`, so autocast changes nothing there.
"""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from d9d.parallel._wrap import wrap_forward
from d9d.parallel.config import PrecisionConfig

__all__ = [
    "MixedPrecision",
    "PrecisionConfig",
    "autocast_forward",
    "enable_tf32",
    "precision_autocast",
    "resolve_precision",
    "to_autocast_dtype",
]

_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class MixedPrecision:
    """Resolved dtypes: what a model provider passes to `parallelize_*` (`precision=`)."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    @property
    def enabled(self) -> bool:
        """True when compute runs in a lower precision than the float32 master weights."""
        return self.param_dtype != torch.float32

    def describe(self) -> str:
        """E.g. "param bfloat16, reduce float32"."""
        return f"param {_name(self.param_dtype)}, reduce {_name(self.reduce_dtype)}"


def resolve_precision(config: PrecisionConfig, device: torch.device | str) -> MixedPrecision:
    """The dtypes `config` means on `device` (`auto`: bfloat16 on CUDA, float32 elsewhere)."""
    device_type = torch.device(device).type
    if config.param_dtype == "auto":
        param = torch.bfloat16 if device_type == "cuda" else torch.float32
    else:
        param = _DTYPES[config.param_dtype]
    return MixedPrecision(param_dtype=param, reduce_dtype=_DTYPES[config.reduce_dtype])


def precision_autocast(
    precision: MixedPrecision | None, device: torch.device | str
) -> contextlib.AbstractContextManager[object]:
    """`torch.autocast` to `precision.param_dtype` on `device`'s type; a no-op for float32 compute.

    Wrap the forward (and loss) of every microbatch in it; backward runs outside it.
    """
    if precision is None or not precision.enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=precision.param_dtype)


def to_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """`x` in the dtype autocast computes in on `x`'s device when autocast is on there (and `x` is a
    float32 tensor), else `x` itself.

    Call it on an embedding's output: autocast leaves a lookup in the table's float32, so without it
    the residual stream, the norms and anything built in the hidden states' dtype (RoPE tables) run
    in float32 on the autocast paths (one device, tensor or pipeline parallel only), while under FSDP
    the gathered table is already bfloat16: the two paths would then differ in numbers too.
    """
    device_type = x.device.type
    if x.dtype != torch.float32 or device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return x
    return x.to(torch.get_autocast_dtype(device_type))


def autocast_forward(module: nn.Module, precision: MixedPrecision | None, device: torch.device | str) -> None:
    """Run `module`'s forward under `precision_autocast`, in place (state-dict keys unchanged); idempotent.

    For loops that do not call the forward themselves, e.g. a pipeline schedule (whose backward must
    not run under autocast).
    """
    if precision is None or not precision.enabled or getattr(module, "_d9d_autocast", False):
        return

    def run(inner: Callable[..., Any], self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with precision_autocast(precision, device):
            return inner(self, *args, **kwargs)

    wrap_forward(module, run)
    module._d9d_autocast = True  # type: ignore[assignment]


def enable_tf32(enabled: bool = True) -> None:
    """Let float32 matmuls and convolutions on CUDA use TF32 tensor cores (or forbid it).

    Set through the `allow_tf32` flags, which keep torch's two views of the setting in agreement:
    after the per-backend `fp32_precision = "tf32"` alone, `torch.get_float32_matmul_precision()`
    and `torch.backends.cuda.matmul.allow_tf32` raise ("mix of the legacy and new APIs", torch 2.11
    to 2.15), and inductor reads them while it compiles (2.11: its autotune cache and FlexAttention).
    """
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
