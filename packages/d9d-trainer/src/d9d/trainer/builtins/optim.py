"""The built-in optimizer (AdamW or SGD) and learning-rate schedule (warmup, then cosine, linear,
constant or warmup-stable-decay), with what raising total_steps on resume does to the schedule."""

import math
from collections.abc import Iterable

import torch
from torch import nn

from d9d.mesh import get_logger
from d9d.trainer.config.job import LRSchedulerConfig, OptimizerConfig
from d9d.trainer.providers.optim import OptimizerStates

__all__ = [
    "BuiltinLRSchedulerProvider",
    "BuiltinOptimizerProvider",
    "lr_multiplier",
    "optimizer_kernels",
    "wsd_decay_start",
]

_log = get_logger("d9d.trainer")


class BuiltinOptimizerProvider:
    """AdamW or SGD from the `optimizer:` section; no weight decay on 1-D parameters (norms, biases)."""

    config_type = OptimizerConfig

    def __init__(self, config: OptimizerConfig) -> None:
        self._config = config

    def optimizer_states(self) -> OptimizerStates:
        """AdamW keeps two moments per parameter, SGD one momentum buffer (none without momentum),
        in `optimizer.state_dtype`."""
        dtype = torch.bfloat16 if self._config.state_dtype == "bfloat16" else None
        if self._config.name == "adamw":
            return OptimizerStates(2, "AdamW: exp_avg + exp_avg_sq", dtype)
        if self._config.momentum:
            return OptimizerStates(1, "SGD with momentum: 1 buffer", dtype)
        return OptimizerStates(0, "SGD without momentum: no state", dtype)

    def build_optimizer(self, named_parameters: Iterable[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        """Two parameter groups: decayed (matrices, embeddings) and not decayed (vectors).

        torch's AdamW / SGD, or with `optimizer.state_dtype: bfloat16` d9d.parallel's
        `StateDtypeAdamW` / `StateDtypeSGD` (the same update, the states kept in bfloat16).
        """
        decay, no_decay = [], []
        for _, param in named_parameters:
            if param.requires_grad:
                (decay if param.ndim >= 2 else no_decay).append(param)
        groups = [
            {"params": decay, "weight_decay": self._config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        params = [p for g in groups for p in g["params"]]
        c = self._config
        kernels = optimizer_kernels(c.implementation, params)
        if c.state_dtype == "bfloat16":
            from d9d.parallel import StateDtypeAdamW, StateDtypeSGD  # DTensor's import: only when used

            if c.name == "adamw":
                return StateDtypeAdamW(groups, lr=c.lr, betas=c.betas, eps=c.eps, **kernels)
            return StateDtypeSGD(groups, lr=c.lr, momentum=c.momentum, **kernels)
        if c.name == "adamw":
            return torch.optim.AdamW(groups, lr=c.lr, betas=c.betas, eps=c.eps, **kernels)
        return torch.optim.SGD(groups, lr=c.lr, momentum=c.momentum, **kernels)


def optimizer_kernels(implementation: str, params: list[torch.Tensor]) -> dict[str, bool]:
    """torch.optim keyword arguments (`fused` / `foreach`) for `optimizer.implementation`.

    `auto` takes fused kernels when every parameter is on CUDA, else foreach; foreach and fused
    kernels refuse a mix of DTensors and plain tensors, where `auto` falls back to the for-loop.

    Raises:
        ConfigError: `fused` or `foreach` was asked for parameters that cannot use it.
    """
    from d9d.trainer.job.load import ConfigError

    kinds = {type(p.data).__name__ == "DTensor" for p in params}
    mixed = len(kinds) > 1
    on_cuda = bool(params) and all(p.device.type == "cuda" for p in params)
    if implementation == "auto":
        if mixed:
            return {"foreach": False}
        return {"fused": True} if on_cuda else {"foreach": True}
    if implementation in ("fused", "foreach") and mixed:
        raise ConfigError(
            f"optimizer.implementation: {implementation} needs every parameter to be a DTensor or every "
            "one a plain tensor, but this model mixes both (a parallelism applied to part of it); "
            "use optimizer.implementation: auto or for_loop"
        )
    if implementation == "fused":
        return {"fused": True}
    if implementation == "foreach":
        return {"foreach": True}
    return {"foreach": False}


def lr_multiplier(
    step: int,
    *,
    name: str,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float,
    decay_ratio: float = 0.1,
    decay_steps: int | None = None,
    decay_shape: str = "linear",
) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based).

    Linear warmup from 1/(warmup+1) to 1 over `warmup_steps`, then `constant`, or decay to
    `min_lr_ratio` at the last step along a cosine or a line; `wsd` stays at 1 until its decay
    (`wsd_decay_start`), whose steps go down to `min_lr_ratio` at the last one along a line or
    1 − √progress (`decay_shape`).
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if name == "constant":
        return 1.0
    if name == "wsd":
        start = wsd_decay_start(total_steps, warmup_steps, decay_ratio, decay_steps)
        if step < start:
            return 1.0
        progress = min(1.0, (step - start + 1) / max(1, total_steps - start))
        drop = math.sqrt(progress) if decay_shape == "1-sqrt" else progress
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - drop)
    decay = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay)
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if name == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def wsd_decay_start(total_steps: int, warmup_steps: int, decay_ratio: float, decay_steps: int | None) -> int:
    """The first (0-based) optimizer step of `wsd`'s decay: `decay_steps` (None: `decay_ratio` ×
    `total_steps`, at least 1) before the end, never inside the warmup."""
    decay = decay_steps if decay_steps is not None else max(1, round(decay_ratio * total_steps))
    return max(warmup_steps, total_steps - decay)


class BuiltinLRSchedulerProvider:
    """Warmup then cosine, linear, constant or warmup-stable-decay, from the `lr_scheduler:` section."""

    config_type = LRSchedulerConfig

    def __init__(self, config: LRSchedulerConfig) -> None:
        self._config = config

    def build_lr_scheduler(
        self, optimizer: torch.optim.Optimizer, total_steps: int
    ) -> torch.optim.lr_scheduler.LRScheduler:
        """A LambdaLR over `lr_multiplier`; its state is the step count, so it resumes exactly."""
        c = self._config
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: lr_multiplier(
                step,
                name=c.name,
                warmup_steps=c.warmup_steps,
                total_steps=total_steps,
                min_lr_ratio=c.min_lr_ratio,
                decay_ratio=c.decay_ratio,
                decay_steps=c.decay_steps,
                decay_shape=c.decay_shape,
            ),
        )

    def new_total_note(self, steps_done: int, before: int, total: int) -> tuple[str, str] | None:
        """What resuming after `steps_done` steps with `trainer.schedule.total_steps` changed from
        `before` to `total` does to this schedule, in one line, and its level: "warning" when the
        learning rate leaves its course (cosine and linear re-stretched, a wsd checkpoint past the
        start of its decay), "info" for wsd going on at the peak; None when nothing moves
        (constant, a warmup, the same total)."""
        c = self._config
        if c.name == "constant" or steps_done < c.warmup_steps or before == total:
            return None
        if c.name != "wsd":
            return "warning", (
                f"lr_scheduler {c.name} is re-stretched over total_steps {total} (was {before}): the "
                f"learning rate jumps onto the new curve at step {steps_done + 1} and decays again to "
                f"step {total}; lr_scheduler.name: wsd is the schedule meant for extension (its decay "
                "stays in the last steps)"
            )
        old_start = wsd_decay_start(before, c.warmup_steps, c.decay_ratio, c.decay_steps)
        start = wsd_decay_start(total, c.warmup_steps, c.decay_ratio, c.decay_steps)
        if steps_done <= old_start:  # every step so far at the peak (or warming up): it goes on
            return "info", (
                f"lr_scheduler wsd goes on at the peak for total_steps {total} (was {before}); its decay "
                f"moves to steps {start + 1}..{total}"
            )
        return "warning", (
            f"the checkpoint of step {steps_done} is past the start of wsd's decay (step {old_start + 1} "
            f"of {before}): the learning rate jumps back up at step {steps_done + 1} for a decay at the "
            f"new end; to extend without a jump, resume from a checkpoint of step {old_start} or before "
            "(move the later ones out of the run directory)"
        )
