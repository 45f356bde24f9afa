"""The task: a microbatch's summed loss and its weight; the pipeline variant of it; the metrics it reports
besides its loss (`ReportsMetrics`); a model that computes its token loss itself (`ComputesTokenLoss`);
and the one place between steps where a training method prepares the step (`PreparesSteps`)."""

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
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
    metrics: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Summed (not averaged) values of the task's `ReportsMetrics.metric_names` over the microbatch
    (0-dim tensors, detached or not); the trainer sums them over the step's microbatches and the
    data-parallel ranks like the loss, without a host read."""


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
        forward: the context the training step runs its forwards in (autocast to the compute dtype,
            the plan's attention kernel): wrap the forwards of a generation in it.
    """

    step: int
    data: Iterator[Any]
    model: nn.Module
    context: DistributedContext
    forward: Callable[[], AbstractContextManager[Any]] = nullcontext


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


@runtime_checkable
class ReportsMetrics(Protocol):
    """A task that reports metrics besides its loss (optional): e.g. DPO's rewards and accuracy.

    Each microbatch's `LossResult.metrics` holds a summed value per name; the trainer sums them over
    the step's microbatches and all data-parallel ranks (the pipeline's last stage's, under pipeline
    parallelism) in the reduction that carries the loss, and records `summarize_metrics` of the totals
    in every step's record (and, prefixed `eval_`, in every eval's), exactly as one process would
    compute them over the same global batch.
    """

    @property
    def metric_names(self) -> Sequence[str]:
        """The names of the summed values, the same on every rank and every step."""
        ...


def metric_names(task: object) -> tuple[str, ...]:
    """`task`'s metric names (`ReportsMetrics`), else none."""
    return tuple(task.metric_names) if isinstance(task, ReportsMetrics) else ()


def metric_sums(names: Sequence[str], result: LossResult, device: torch.device) -> torch.Tensor:
    """The summed values of `names` in `result.metrics`, as one float64 vector on `device` (detached).

    Raises:
        ValueError: `result.metrics` lacks one of `names`.
    """
    missing = [name for name in names if name not in result.metrics]
    if missing:
        raise ValueError(
            f"the task declares metrics {missing} (metric_names) but its LossResult.metrics lacks them; "
            "return every declared metric from compute_loss and pipeline_loss"
        )
    if not names:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.stack([result.metrics[n].detach().to(device, torch.float64).reshape(()) for n in names])


def summarize_metrics(task: object, sums: Sequence[float], weight: float) -> dict[str, float]:
    """The reported values of `task`'s metrics from their global sums and the global weight: the task's
    own `summarize_metrics(sums: dict, weight) -> dict` when it has one (e.g. an F1 from counts), else
    each sum over the weight (the mean per unit of weight, as the loss)."""
    names = metric_names(task)
    totals = dict(zip(names, sums, strict=True))
    own = getattr(task, "summarize_metrics", None)
    if callable(own):
        return {str(k): float(v) for k, v in own(totals, weight).items()}
    return {name: (value / weight if weight else float("nan")) for name, value in totals.items()}


@dataclass(frozen=True)
class PrepareRunContext:
    """What `prepare_run` may use, once per launch before its first step or eval.

    Attributes:
        run_dir: the run's directory: a task may keep files there (the main process writes them,
            atomically); they survive a crash and a resume.
        model: this rank's (parallelized) model.
        context: where this rank sits (mesh, coordinates, device).
        datasets: the job's map-style datasets by role: "train" (`providers.dataset`) and "eval"
            (`providers.eval_dataset`), those it has.
        restored: the model holds a checkpoint's weights (a resumed run), not its starting weights.
        forward_only: `forward_only(role)` runs the task over every sample of the dataset of that
            role once (collated by its provider's collate function), across the data-parallel ranks (microbatches of `data.microbatch_size`, in
            index order), forward only, no grad, model in eval mode, on any mesh (the pipeline's stages
            included): each microbatch goes to `compute_loss` (or `pipeline_loss` on the last stage),
            like an eval's; what the task keeps from them is its own.
    """

    run_dir: Path
    model: nn.Module
    context: DistributedContext
    datasets: Mapping[str, Any]
    restored: bool
    forward_only: Callable[[str], None]


@runtime_checkable
class PreparesRun(Protocol):
    """A task that prepares the run once before its first step (optional): e.g. a preference task
    computes its reference log-probabilities with the starting weights and keeps them in the run
    directory, so a resumed run reads them back instead."""

    def prepare_run(self, context: PrepareRunContext) -> None:
        """Prepare (every rank calls it, with the same context on each)."""
        ...


@runtime_checkable
class ShapesBatch(Protocol):
    """A task whose microbatches are not `input_ids` and `labels` of one row per sample (optional): it
    gives the planner a microbatch of its own shape on the meta device, so `d9d plan` estimates its
    activations as it runs (e.g. a preference task: two rows per pair, the pairs' ids)."""

    def planning_batch(self, microbatch_size: int, seq_len: int, packed: bool) -> dict[str, torch.Tensor]:
        """A microbatch of `microbatch_size` samples of `seq_len` tokens, as meta tensors."""
        ...


def tensor_state(tensor: torch.Tensor) -> dict[str, Any]:
    """`tensor` as plain data a checkpoint's extra state holds (a task's `state_dict`): its dtype, shape
    and bytes, copied to the host. `tensor_from_state` reverses it."""
    tensor = tensor.detach().cpu().contiguous()
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "data": tensor.numpy().tobytes()}  # fmt: skip


def tensor_from_state(state: Mapping[str, Any]) -> torch.Tensor:
    """The tensor `tensor_state` described (on the host, owning its memory)."""
    dtype = getattr(torch, state["dtype"])
    return torch.frombuffer(bytearray(state["data"]), dtype=dtype).reshape(state["shape"])
