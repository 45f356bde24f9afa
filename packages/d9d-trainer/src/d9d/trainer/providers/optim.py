"""The optimizer and learning-rate schedule providers; optimizer state declared for the memory estimate."""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class OptimizerProvider(Protocol):
    """Builds the optimizer (the `optimizer:` section is its config)."""

    def build_optimizer(self, named_parameters: Iterable[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        """Return an optimizer over the trainable parameters."""
        ...


@dataclass(frozen=True)
class OptimizerStates:
    """The optimizer tensors kept per trainable parameter, as an optimizer provider declares them.

    Attributes:
        per_parameter: state tensors of each parameter's shape (AdamW 2, SGD momentum 1).
        description: what they are, for `d9d plan` (e.g. "AdamW: exp_avg + exp_avg_sq").
        dtype: their dtype; None: the parameter's (float32 master weights). A provider that keeps
            them in bfloat16 declares `torch.bfloat16`, which `optimizer.state_dtype: bfloat16` needs.
    """

    per_parameter: int
    description: str
    dtype: torch.dtype | None = None


@runtime_checkable
class DeclaresOptimizerStates(Protocol):
    """An optimizer provider that says what state it keeps per parameter (for the memory estimate)."""

    def optimizer_states(self) -> OptimizerStates:
        """Its state tensors per trainable parameter, from the config alone."""
        ...


@runtime_checkable
class LRSchedulerProvider(Protocol):
    """Builds the learning-rate schedule (the `lr_scheduler:` section is its config)."""

    def build_lr_scheduler(
        self, optimizer: torch.optim.Optimizer, total_steps: int
    ) -> torch.optim.lr_scheduler.LRScheduler:
        """Return a scheduler stepped once per optimizer step."""
        ...
