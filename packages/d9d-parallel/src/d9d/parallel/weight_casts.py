"""Weights cast once per step: one compute-dtype copy of each float32 weight for all of a step's microbatches.

Without FSDP2 mixed precision (one device, tensor or pipeline parallelism, FSDP-ignored expert banks)
autocast casts every float32 weight a matmul reads in every microbatch's forward, and again in each
activation-checkpoint recompute; code that casts a weight itself (a norm's scale, an expert bank)
does the same. Inside `weights_cast_once()` (one optimizer step's forwards and backwards) each
weight is cast once: the copy lives until the scope ends, and its cast's backward adds every
microbatch's gradient into the float32 parameter, so the numbers are bit-identical to casting in every
forward. The cost: the copies stay alive for the step, the compute dtype's bytes of every cast weight
(half the float32 weights in bfloat16); without activation checkpointing each microbatch's forward
saved those copies for its backward anyway.

Two ways in: `cast_weight(w, dtype)` for code that casts a weight itself, and `cast_linears_once(model)`,
which gives every plain `nn.Linear` its cached weight and bias while autocast is on (what autocast
would cast). A copy is made again when its parameter changed in place (its version counter) or when
the scope needs a gradient that a no-grad copy lacks.

Not autocast's own cache: torch clears it (for every thread) whenever a thread leaves its outermost
autocast region, and on CUDA an activation-checkpoint recompute runs in autograd's device thread and
leaves one: one cache per step is not something autocast keeps. Compiled code (`torch.compile`) casts
inside its graph as before: the hooks and `cast_weight` step aside while dynamo traces.
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["WeightCasts", "cast_linears_once", "cast_once_parameters", "cast_weight", "weights_cast_once"]

_HOOKED = "_d9d_cast_once"
_SWAPPED = "_d9d_cast_once_swapped"


@dataclass
class _Copy:
    weight: torch.Tensor  # keeps id(weight) from being reused while the copy is cached
    copy: torch.Tensor
    version: int


class WeightCasts:
    """The compute-dtype copies of one `weights_cast_once` scope, keyed by the weight (and dtype)."""

    def __init__(self) -> None:
        self._copies: dict[tuple[int, torch.dtype], _Copy] = {}
        self.casts = 0
        """Casts made in this scope (one per weight and dtype, unless a weight changed in place)."""

    def get(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`weight` in `dtype`, cast on first use in the scope and reused after."""
        key = (id(weight), dtype)
        found = self._copies.get(key)
        needs_grad = weight.requires_grad and torch.is_grad_enabled()
        if (
            found is not None
            and found.version == weight._version
            and (found.copy.requires_grad or not needs_grad)
        ):
            return found.copy
        copy = weight.to(dtype)
        self._copies[key] = _Copy(weight, copy, weight._version)
        self.casts += 1
        return copy

    def copies(self) -> list[torch.Tensor]:
        """The copies alive in the scope."""
        return [c.copy for c in self._copies.values()]

    @property
    def bytes(self) -> int:
        """Bytes of the copies alive in the scope (this rank's part of a DTensor)."""
        return sum(_local_bytes(c.copy) for c in self._copies.values())


_active: WeightCasts | None = None  # one per process: the recompute may run in autograd's device thread


@contextlib.contextmanager
def weights_cast_once(enabled: bool = True) -> Iterator[WeightCasts | None]:
    """Within it, `cast_weight` and the hooks of `cast_linears_once` cast each weight once; the copies
    are dropped on exit. Wrap one optimizer step's forwards and backwards (not the optimizer step).
    A nested scope is the enclosing one. `enabled=False`: no scope (yields None)."""
    global _active
    if not enabled or _active is not None:
        yield _active
        return
    _active = WeightCasts()
    try:
        yield _active
    finally:
        _active = None


def cast_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight.to(dtype)`, inside `weights_cast_once` the scope's one copy; `weight` when already `dtype`."""
    if weight.dtype == dtype:
        return weight
    scope = _active
    if scope is None or torch.compiler.is_compiling():
        return weight.to(dtype)
    return scope.get(weight, dtype)


def open_scope_copies() -> list[torch.Tensor]:
    """The copies the open `weights_cast_once` scope holds (none outside a scope)."""
    return _active.copies() if _active is not None else []


def step_copy(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """For an op that computes its own gradient of `weight` (in float32): the open scope's copy of
    `weight` in `dtype`, made without autograd on first use; None outside a scope, while compiling,
    or when `weight` is in `dtype` already (the op casts as before)."""
    scope = _active
    if scope is None or weight.dtype == dtype or torch.compiler.is_compiling():
        return None
    with torch.no_grad():
        return scope.get(weight, dtype)


def cast_linears_once(module: nn.Module) -> int:
    """Hook every plain `nn.Linear` in `module` (a subclass with its own forward, e.g. a float8 linear,
    is left alone) so that, inside `weights_cast_once` and under autocast, its forward reads the
    scope's copies of its float32 weight and bias; idempotent. Returns how many linears are hooked."""
    count = 0
    for sub in module.modules():
        if not isinstance(sub, nn.Linear) or type(sub).forward is not nn.Linear.forward:
            continue
        if not getattr(sub, _HOOKED, False):
            sub.register_forward_pre_hook(_swap_in)
            sub.register_forward_hook(_swap_back, always_call=True)
            setattr(sub, _HOOKED, True)
        count += 1
    return count


def cast_once_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of `module` a step inside `weights_cast_once` keeps a compute copy of, an upper
    bound: every floating parameter but embedding tables and the weights of linears with a forward of
    their own (float8), which compute from float32 (a weight held by both, a tied head, counts); a
    linear whose class sets `casts_weight_once` (the fused LM head: `step_copy`) counts. A float32
    norm scale that its module never casts counts too."""
    keep: set[int] = set()
    for sub in module.modules():
        from_float32 = isinstance(sub, nn.Embedding) or (
            isinstance(sub, nn.Linear)
            and type(sub).forward is not nn.Linear.forward
            and not getattr(sub, "casts_weight_once", False)
        )
        if not from_float32:
            keep.update(id(p) for p in sub._parameters.values() if p is not None and p.is_floating_point())
    return [p for p in module.parameters() if id(p) in keep]


def _swap_in(module: nn.Module, args: Any) -> None:
    scope = _active
    if scope is None or torch.compiler.is_compiling():
        return
    params = module._parameters
    weight = params["weight"]
    device_type = weight.device.type if weight is not None else "cpu"
    if weight is None or not torch.is_autocast_enabled(device_type):
        return
    dtype = torch.get_autocast_dtype(device_type)
    swapped = {}
    for name in ("weight", "bias"):
        param = params.get(name)
        if param is not None and param.dtype == torch.float32 and dtype != torch.float32:
            swapped[name] = param
            params[name] = scope.get(param, dtype)  # type: ignore[assignment]
    if swapped:
        setattr(module, _SWAPPED, swapped)


def _swap_back(module: nn.Module, args: Any, output: Any) -> None:
    swapped = module.__dict__.pop(_SWAPPED, None)
    if swapped:
        module._parameters.update(swapped)


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()
