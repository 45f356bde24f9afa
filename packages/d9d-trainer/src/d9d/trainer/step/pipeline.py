"""The pipeline step: the step's microbatches through a pipeline schedule (one or several stages per rank)."""

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from d9d.parallel import autocast_forward
from d9d.parallel.pipeline import Pipeline, PipelineLayout
from d9d.trainer.errors import TrainingError
from d9d.trainer.providers.task import LossResult, PipelineStageKwargs, PipelineTask, metric_sums
from d9d.trainer.step.base import StepBase, StepOutput, StepSettings

__all__ = ["PipelineStep"]


class PipelineStep(StepBase):
    """Runs `d9d.parallel.pipeline.Pipeline` over the microbatches; the last stage's loss is normalized by the
    global batch's weight, as the plain step's. Each stage forward of a microbatch draws from the
    stream of (microbatch, stage) (`TrainingRandomness.seed_microbatch`), whatever the schedule's
    order (torch's metadata-inference forward of a launch's first step seeds none)."""

    def __init__(
        self,
        model: nn.Module,
        task: PipelineTask,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        settings: StepSettings,
        *,
        layout: PipelineLayout,
        n_microbatches: int,
        chunks: Sequence[nn.Module] | None = None,
    ) -> None:
        """`model` holds all of this rank's parameters (a `StageChunks` over `chunks` when the schedule
        gives the rank several stages); `chunks` are the stage modules the schedule runs."""
        super().__init__(model, task, optimizer, scheduler, settings)
        self.pipeline_task = task
        if any(layer.balancing.adds_loss for layer in self.moes):
            raise TrainingError(
                "MoE balancing losses (aux_loss_coef, z_loss_coef) with mesh.pipeline_parallel > 1 are not "
                "supported yet (the schedule's loss is the last stage's); use the score bias "
                "(bias_update_rate) alone, or mesh.pipeline_parallel: 1"
            )
        self._scale = torch.ones((), device=settings.device)
        chunks = list(chunks) if chunks is not None else [model]
        self._chunks = chunks
        for chunk in chunks:
            autocast_forward(chunk, settings.precision, settings.device)  # the forward only, not backward
        self.pipeline = Pipeline(
            layout,
            chunks,
            pp_group=settings.pp_group,
            n_microbatches=n_microbatches,
            loss_fn=self._loss,
            device=settings.device,
        )
        self._step = 0
        self._metric_rows: dict[int, torch.Tensor] = {}  # the last stage's metric sums by microbatch
        self._targets: list[Any] | None = None  # the step's targets when they are not one tensor each
        # Without per-stage forward contexts (older torch): one stream per step, in schedule order.
        self._per_step_stream = settings.randomness is not None and not self.pipeline.around_stage_forwards(
            self._stage_forward
        )

    def _stage_forward(self, stage: int, microbatch: int, probe: bool) -> AbstractContextManager[None]:
        randomness = self.settings.randomness
        if randomness is not None and not probe:  # the probe is no microbatch: it seeds no stream
            randomness.seed_microbatch(self._step, microbatch, self.pipeline.n_microbatches, stage=stage)
        return nullcontext()

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        index = None
        if self._targets is not None:  # the schedule carried the target's index (see `run`)
            index = target.shape[1] - 1
            target = self._targets[index]
        result = self.pipeline_task.pipeline_loss(output, target)
        if index is not None and self.metric_names:  # the last stage's metrics of each microbatch, kept
            # by index: torch's metadata-inference forward of a launch's first step computes a loss too
            self._metric_rows[index] = metric_sums(self.metric_names, result, self.settings.device)
        return result.loss_sum / self._scale

    def _stage_kwargs(self, microbatches: Sequence[Any]) -> list[dict[str, Any]] | None:
        """Per microbatch, the keyword inputs of every stage's forward (`PipelineStageKwargs`: e.g. the
        labels of a last stage whose head computes the loss); None when the task gives none."""
        task, device = self.pipeline_task, self.settings.device
        if not isinstance(task, PipelineStageKwargs):
            return None
        return [
            {k: v.to(device) for k, v in task.pipeline_kwargs(mb, self._chunks).items()}
            for mb in microbatches
        ]

    def forward_only(self, microbatches: Sequence[Any]) -> list[LossResult] | None:
        """The task's loss of each microbatch (already this rank's part), forward only through the
        pipeline (`Pipeline.forward_only`: any count and shape of microbatches; the evaluation); on the
        rank with the last stage, else None. Call it under `torch.no_grad()`, the stages in eval mode."""
        device = self.settings.device
        pairs = [self.pipeline_task.pipeline_inputs(mb) for mb in microbatches]
        inputs = [x.to(device) for x, _ in pairs]
        outputs = self.pipeline.forward_only(inputs, kwargs=self._stage_kwargs(microbatches))
        if outputs is None:
            return None
        return [
            self.pipeline_task.pipeline_loss(out, _to_device(y, device))
            for out, (_, y) in zip(outputs, pairs, strict=True)
        ]

    def from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        """`value` of the rank with the last stage, on every pipeline rank (`Pipeline.from_last_stage`)."""
        return self.pipeline.from_last_stage(value)

    def run(self, microbatches: Sequence[Any], step: int) -> StepOutput:
        """One optimizer step: the schedule's forward/backward (one "forward_backward" phase of the
        step-time breakdown: the schedule interleaves them), then the shared update."""
        device = self.settings.device
        microbatches = self.local_part(microbatches)
        weight = self.global_weight(microbatches)
        self._scale = weight.to(torch.float32)
        self.float8_scales()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        pairs = [self.pipeline_task.pipeline_inputs(mb) for mb in microbatches]
        inputs = [x.to(device) for x, _ in pairs]
        targets = [_to_device(y, device) for _, y in pairs]
        self._metric_rows = {}
        if self.metric_names or any(not isinstance(y, torch.Tensor) for y in targets):
            # torch's schedules take one tensor per target: give them an empty tensor whose shape holds
            # the microbatch's index (no device read), and the loss the task's target of that index
            self._targets = targets
            targets = [torch.empty(0, i + 1, device=device) for i in range(len(targets))]
        kwargs = self._stage_kwargs(microbatches)
        self._step = step
        if self._per_step_stream and self.settings.randomness is not None:
            self.settings.randomness.seed_pipeline(step)
        # the schedule interleaves forwards and backwards: the kernel choice and the weights' compute
        # copies (one for all microbatches) hold around the whole of it
        with self.settings.attention_kernels(), self.weights_cast_once():
            share = self.pipeline.step(inputs, targets, kwargs=kwargs, broadcast_loss=True)
        self._targets = None
        assert share is not None
        self.add_expert_load()  # the stage's MoE layers hold the step's last microbatch
        loss = self.dp_sum(share.detach().to(torch.float64))
        metrics = None
        if self.metric_names:  # the last stage's sums, on every pipeline rank, then over dp
            sums = torch.zeros(len(self.metric_names), dtype=torch.float64, device=device)
            for row in self._metric_rows.values():
                sums += row
            metrics = self.dp_sum(self.pipeline.from_last_stage(sums))
        return self.finish(loss, weight, step, metrics=metrics)


def _to_device(value: Any, device: torch.device) -> Any:
    """`value` on `device`: a tensor, or a mapping of tensors (a task's target with several parts)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    return value
