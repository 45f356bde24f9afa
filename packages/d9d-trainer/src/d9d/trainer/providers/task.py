"""The task: a microbatch's summed loss and its weight; the pipeline variant of it; a model that computes
its token loss itself (`ComputesTokenLoss`); and the one place between steps where a training method
prepares the step (`PreparesSteps`)."""

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from d9d.mesh import DistributedContext


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

    # Optional: `PipelineTask` (pipeline parallelism), `PreparesSteps` (the step's microbatches).


@runtime_checkable
class PipelineTask(Task, Protocol):
    """A task that can also run under pipeline parallelism (the pipeline runs the forward itself)."""

    def pipeline_inputs(self, batch: Any) -> tuple[Any, Any]:
        """(the first stage's input, the target given to `pipeline_loss`) of a microbatch."""
        ...

    def pipeline_loss(self, output: Any, target: Any) -> LossResult:
        """The summed loss of the last stage's `output` against `target`."""
        ...


@runtime_checkable
class PipelineStageKwargs(Protocol):
    """A pipeline task whose stages also take keyword inputs of the microbatch (optional)."""

    def pipeline_kwargs(self, batch: Any, stages: Sequence[nn.Module]) -> Mapping[str, Any]:
        """Keyword inputs of every stage's forward for `batch`, given this rank's stage modules
        (e.g. a packed batch's `position_ids` and `document_ids`, which every stage's attention needs;
        `labels` for a last stage whose head computes the loss: `ComputesTokenLoss`)."""
        ...


@runtime_checkable
class ComputesTokenLoss(Protocol):
    """A causal LM that computes its summed token cross-entropy itself (optional; the reference model
    and the Hugging Face backend do, with `trainer.loss.fused`).

    When `fused_loss_chunk_size` is not None, `model(input_ids, ..., labels=labels)` returns that loss
    (float32, 0-dim) instead of the logits: the head and the loss fused over chunks of that many tokens
    (`d9d.parallel.linear_cross_entropy`, inside the head's forward), so no [tokens, vocab] logits
    exist. A pipeline stage without the head takes `labels` and returns its hidden states.
    """

    @property
    def fused_loss_chunk_size(self) -> int | None:
        """Tokens per chunk of the fused loss; None: the head is not fused (the model returns logits)."""
        ...


def fused_loss_chunk_size(model: nn.Module) -> int | None:
    """`model`'s fused-loss chunk size when it declares `ComputesTokenLoss`, else None."""
    return model.fused_loss_chunk_size if isinstance(model, ComputesTokenLoss) else None


@dataclass(frozen=True)
class PrepareStepContext:
    """What `prepare_step` may use to make a step's microbatches.

    Attributes:
        step: the optimizer step about to run (1-based); the previous step's update is applied.
        data: the data provider's steps: `next(data)` is one step's microbatches as the provider
            batches them (e.g. the prompts to roll out); its position is part of every checkpoint.
        model: this rank's (parallelized) model with the current weights, in train mode.
        context: where this rank sits (mesh, coordinates, device).
    """

    step: int
    data: Iterator[Any]
    model: nn.Module
    context: DistributedContext


@runtime_checkable
class PreparesSteps(Protocol):
    """A task that makes each step's microbatches itself, between two optimizer steps (optional).

    The run loop's one place for a training method that acts between steps without forking the
    trainer: generate rollouts from the current weights and score them (RL), sync the weights to an
    inference engine, or draw from another source. Without it, a step's microbatches are
    `next(data)`. Every rank calls it for every step, in step order; the microbatches it returns
    go to `batch_weight` and `compute_loss` (or the pipeline) like the data provider's.
    """

    def prepare_step(self, context: PrepareStepContext) -> Any:
        """The microbatches of step `context.step` (a list, as the data provider yields them)."""
        ...
