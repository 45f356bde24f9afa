"""The task: a microbatch's summed loss and its weight; the pipeline variant of it."""

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@dataclass(frozen=True)
class LossContext:
    """One microbatch to compute the loss of."""

    model: nn.Module
    batch: Any
    device: torch.device


@dataclass(frozen=True)
class LossResult:
    """The summed (not averaged) loss of a microbatch and how many units it sums over.

    The trainer divides by the step's global weight (e.g. all tokens of the global batch), so the
    gradient is the single-device gradient of the global batch whatever the mesh and microbatching.
    """

    loss_sum: torch.Tensor
    weight: float | torch.Tensor


@runtime_checkable
class Task(Protocol):
    """Turns a batch into a loss."""

    def batch_weight(self, batch: Any) -> float | torch.Tensor:
        """The weight a microbatch contributes to its step (known before the forward pass).

        Return a tensor rather than a Python number where computing it would read a tensor: the
        trainer sums the weights on the device and never waits for them.
        """
        ...

    def compute_loss(self, context: LossContext) -> LossResult:
        """Forward the model on the batch and return the summed loss."""
        ...

    # Optional, for pipeline parallelism: `PipelineTask`.


@runtime_checkable
class PipelineTask(Task, Protocol):
    """A task that can also run under pipeline parallelism (the pipeline runs the forward itself)."""

    def pipeline_inputs(self, batch: Any) -> tuple[Any, Any]:
        """(the first stage's input, the target given to `pipeline_loss`) of a microbatch."""
        ...

    def pipeline_loss(self, output: Any, target: Any) -> LossResult:
        """The summed loss of the last stage's `output` against `target`."""
        ...
