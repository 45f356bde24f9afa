"""Optimizer states in a lower precision: AdamW's moments and SGD's momentum kept in bfloat16.

`StateDtypeAdamW` and `StateDtypeSGD` are torch's `AdamW` and `SGD` whose per-parameter buffers
(`exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`; `momentum_buffer`) are stored in `state_dtype`, half the
bytes of float32 states in bfloat16. Each step upcasts the buffers to the parameter's dtype (float32
master weights: float32) in chunks of at most `chunk_elements` elements, all the parameters of a
chunk in one call of torch's own functional update (`torch.optim.adam.adam`, `torch.optim.sgd.sgd`,
with the group's foreach or fused kernels) against the parameter and gradient themselves (views, no
copy), and copies the buffers back, which rounds them to the nearest bfloat16 (ties to even). So the
update is torch's given the stored states; the only difference from float32 states is that rounding
after every step. The upcast copies of one chunk are the only extra memory: `chunk_elements` × 4
bytes per buffer (2**25 elements: 128 MiB).

DTensor parameters (FSDP2, tensor parallelism) update their local shards, so the update never
communicates and the buffers are DTensors of the parameter's placements, which torch's distributed
checkpoints save and reshard as any optimizer state. Loading casts: a state dict holding float32
buffers (a run with float32 states) loads into bfloat16 buffers, and torch's float32 optimizers load
a bfloat16 one (`Optimizer.load_state_dict` casts to the parameter's dtype; these keep `state_dtype`).
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as _adam
from torch.optim.optimizer import ParamsT
from torch.optim.sgd import sgd as _sgd

__all__ = ["StateDtypeAdamW", "StateDtypeSGD", "optimizer_state_bytes"]

#: Elements upcast at once per buffer: 2**25 float32 elements are 128 MiB per buffer.
DEFAULT_CHUNK_ELEMENTS = 2**25


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the per-parameter buffers this rank holds in `optimizer.state` (a DTensor's local
    shard), counted from the tensors; the scalar `step` counters are left out."""
    total = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):
                local = _local(value)
                total += local.numel() * local.element_size()
    return total


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (aliasing it: in-place updates reach the DTensor), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass
class _Piece:
    """One contiguous range of one parameter: views of the parameter, its gradient and its buffers."""

    param: torch.Tensor
    grad: torch.Tensor
    buffers: list[torch.Tensor]
    fresh: bool
    step: torch.Tensor | None


class _Chunked:
    """The chunked step shared by both optimizers (a mixin ahead of the torch optimizer class)."""

    state_dtype: torch.dtype
    chunk_elements: int
    param_groups: list[dict[str, Any]]
    state: Any

    def _init_chunked(self, state_dtype: torch.dtype, chunk_elements: int) -> None:
        if not state_dtype.is_floating_point:
            raise ValueError(f"state_dtype must be a floating-point dtype, got {state_dtype}")
        if chunk_elements < 1:
            raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
        self.state_dtype = state_dtype
        self.chunk_elements = chunk_elements
        self.register_load_state_dict_post_hook(_keep_state_dtype)  # type: ignore[attr-defined]

    # -- what each optimizer defines

    def _buffer_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        raise NotImplementedError

    def _init_state(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> bool:
        """Create the state of a parameter seen for the first time; True when its buffers are new
        and torch's update must initialize them itself (SGD's momentum starts as the gradient)."""
        raise NotImplementedError

    def _update(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        buffers: list[list[Any]],
        steps: list[torch.Tensor],
    ) -> None:
        """Torch's functional update of one chunk; it may fill the Nones in `buffers` (fresh ones)."""
        raise NotImplementedError

    # -- the step

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update of every parameter with a gradient (torch's `Optimizer.step` contract)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        names = self._buffer_names(group)
        pieces: list[_Piece] = []
        size = 0
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if isinstance(p, DTensor) and (
                not isinstance(p.grad, DTensor) or p.grad.placements != p.placements
            ):
                raise RuntimeError(
                    f"{type(self).__name__}: a gradient is not laid out like its DTensor parameter "
                    f"({getattr(p.grad, 'placements', 'a plain tensor')} vs {p.placements}); reduce it first"
                )
            state = self.state[p]
            fresh = self._init_state(p, state, group) if not state else False
            before = None
            if "step" in state:  # every piece of the parameter starts from the same count
                before = state["step"].clone()
                state["step"] += 1
            param, grad = _local(p), _local(p.grad)
            buffers = [_local(state[name]) for name in names]
            if not param.is_contiguous() or not grad.is_contiguous():  # whole, however large
                if pieces and size + param.numel() > self.chunk_elements:
                    self._flush(group, pieces)
                    pieces, size = [], 0
                pieces.append(_Piece(param, grad, buffers, fresh, before))
                size += param.numel()
                continue
            flat = (param.view(-1), grad.view(-1), [b.view(-1) for b in buffers])
            offset, n = 0, param.numel()
            while offset < n:
                take = min(n - offset, self.chunk_elements - size)
                end = offset + take
                pieces.append(
                    _Piece(flat[0][offset:end], flat[1][offset:end], [b[offset:end] for b in flat[2]],
                           fresh, before)
                )  # fmt: skip
                size += take
                offset = end
                if size >= self.chunk_elements:
                    self._flush(group, pieces)
                    pieces, size = [], 0
        if pieces:
            self._flush(group, pieces)

    def _flush(self, group: dict[str, Any], pieces: list[_Piece]) -> None:
        """Upcast one chunk's buffers, run torch's update on it, round them back into the buffers."""
        count = len(pieces[0].buffers)
        work: list[list[Any]] = [
            [None if piece.fresh else piece.buffers[k].to(piece.param.dtype) for piece in pieces]
            for k in range(count)
        ]
        steps = [piece.step.clone() for piece in pieces if piece.step is not None]
        self._update(group, [p.param for p in pieces], [p.grad for p in pieces], work, steps)
        for k in range(count):
            for piece, value in zip(pieces, work[k], strict=True):
                piece.buffers[k].copy_(value)  # float32 -> bfloat16 rounds to nearest, ties to even


def _keep_state_dtype(optimizer: torch.optim.Optimizer) -> None:
    """After `load_state_dict` (which casts every state to its parameter's dtype): back to `state_dtype`."""
    dtype = optimizer.state_dtype  # type: ignore[attr-defined]
    for state in optimizer.state.values():
        for key, value in list(state.items()):
            if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                state[key] = value.to(dtype)


class StateDtypeAdamW(_Chunked, torch.optim.AdamW):
    """`torch.optim.AdamW` with its moments stored in `state_dtype` (default bfloat16).

    Args:
        state_dtype: the dtype of `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq`); the `step` counter
            stays float32, as torch keeps it.
        chunk_elements: how many elements of each buffer are upcast at once.
        foreach, fused: torch's kernels for each chunk (fused: CUDA). capturable and differentiable
            are not offered.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        state_dtype: torch.dtype = torch.bfloat16,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    ) -> None:
        torch.optim.AdamW.__init__(
            self, params, lr, betas, eps, weight_decay, amsgrad,
            maximize=maximize, foreach=foreach, fused=fused,
        )  # fmt: skip
        self._init_chunked(state_dtype, chunk_elements)

    def _buffer_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")

    def _init_state(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> bool:
        # where torch keeps the count: on the device for the fused kernels, else a CPU scalar
        device = param.device if group["fused"] else "cpu"
        state["step"] = torch.zeros((), dtype=torch.float32, device=device)
        for name in self._buffer_names(group):
            state[name] = torch.zeros_like(param, dtype=self.state_dtype, memory_format=torch.preserve_format)
        return False

    def _update(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        buffers: list[list[Any]],
        steps: list[torch.Tensor],
    ) -> None:
        beta1, beta2 = group["betas"]
        _adam(
            params,
            grads,
            buffers[0],
            buffers[1],
            buffers[2] if group["amsgrad"] else [],
            steps,
            foreach=group["foreach"],
            fused=group["fused"],
            grad_scale=getattr(self, "grad_scale", None),
            found_inf=getattr(self, "found_inf", None),
            decoupled_weight_decay=group["decoupled_weight_decay"],
            amsgrad=group["amsgrad"],
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
        )


class StateDtypeSGD(_Chunked, torch.optim.SGD):
    """`torch.optim.SGD` with its momentum buffer stored in `state_dtype` (default bfloat16).

    Without momentum SGD keeps no state, and this is torch's SGD. The first step's buffer is the
    gradient itself, as torch's update makes it (rounded to `state_dtype`).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        state_dtype: torch.dtype = torch.bfloat16,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    ) -> None:
        torch.optim.SGD.__init__(
            self, params, lr, momentum, dampening, weight_decay, nesterov,
            maximize=maximize, foreach=foreach, fused=fused,
        )  # fmt: skip
        self._init_chunked(state_dtype, chunk_elements)

    def _buffer_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _init_state(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> bool:
        if group["momentum"] == 0:
            return False
        state["momentum_buffer"] = torch.zeros_like(
            param, dtype=self.state_dtype, memory_format=torch.preserve_format
        )
        return True

    def _update(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        buffers: list[list[Any]],
        steps: list[torch.Tensor],
    ) -> None:
        del steps
        momentum = buffers[0] if buffers else [None] * len(params)
        _sgd(
            params,
            grads,
            momentum,
            foreach=group["foreach"],
            fused=group["fused"],
            grad_scale=getattr(self, "grad_scale", None),
            found_inf=getattr(self, "found_inf", None),
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
        )
