"""The pipeline step: the step's microbatches through a pipeline schedule (one or several stages per rank)."""

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from d9d.parallel import Pipeline, PipelineLayout, autocast_forward
from d9d.trainer.providers import Task
from d9d.trainer.step.base import StepBase, StepOutput, StepSettings

__all__ = ["PipelineStep", "pipeline_layout", "plan_pipeline_stage"]


class PipelineStep(StepBase):
    """Runs `d9d.parallel.Pipeline` over the microbatches; the last stage's loss is normalized by the
    global batch's weight, as the plain step's."""

    def __init__(
        self,
        model: nn.Module,
        task: Task,
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
        self._scale = torch.ones((), device=settings.device)
        chunks = list(chunks) if chunks is not None else [model]
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

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        result = self.task.pipeline_loss(output, target)  # type: ignore[attr-defined]
        return result.loss_sum / self._scale

    def run(self, microbatches: Sequence[Any], step: int) -> StepOutput:
        """One optimizer step: the schedule's forward/backward (one "forward_backward" phase of the
        step-time breakdown: the schedule interleaves them), then the shared update."""
        device = self.settings.device
        microbatches = self.local_part(microbatches)
        weight = self.global_weight(microbatches)
        self._scale = weight.to(torch.float32)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        pairs = [self.task.pipeline_inputs(mb) for mb in microbatches]  # type: ignore[attr-defined]
        inputs = [x.to(device) for x, _ in pairs]
        targets = [y.to(device) for _, y in pairs]
        share = self.pipeline.step(inputs, targets, broadcast_loss=True)
        assert share is not None
        loss = self.dp_sum(share.detach().to(torch.float64))
        return self.finish(loss, weight, step)


def pipeline_layout(job: Any, pp_size: int, n_microbatches: int | None) -> PipelineLayout:
    """The job's pipeline layout for `pp_size` ranks (what `d9d plan` shows and each rank builds).

    `n_microbatches` None (a custom data provider decides them) skips the schedule's microbatch check.

    Raises:
        TrainingError: the model provider or the task cannot run a pipeline.
        PipelineError: the schedule, stage, layer or microbatch counts do not fit.
    """
    from d9d.parallel import PipelineConfig, plan_pipeline
    from d9d.trainer.errors import TrainingError

    pcfg = job.config.pipelining
    config = PipelineConfig(pcfg.schedule, pcfg.stages_per_rank)
    count = getattr(job.model_provider, "pipeline_num_layers", None)
    if count is None:
        raise TrainingError(
            "mesh.pipeline_parallel > 1 needs a model provider with pipeline_num_layers() and stage "
            "support in initialize_model_stage (context.stage); see docs/parallelism.md"
        )
    task = job.task
    if not (hasattr(task, "pipeline_inputs") and hasattr(task, "pipeline_loss")):
        raise TrainingError(
            "mesh.pipeline_parallel > 1 needs a task with pipeline_inputs() and pipeline_loss()"
        )
    return plan_pipeline(
        int(count()),
        pp_size,
        config,
        embedding_weight=pcfg.embedding_weight,
        head_weight=pcfg.head_weight,
        n_microbatches=n_microbatches,
    )


def plan_pipeline_stage(job: Any, context: Any, data: Any) -> tuple[PipelineLayout, tuple[Any, ...], int]:
    """(layout, this rank's stages, microbatches per step) for `mesh.pipeline_parallel` > 1.

    Single-stage schedules (gpipe, 1f1b) give one stage per rank; the multi-stage ones
    (`pipelining.stages_per_rank`, V-shaped for zbv and dualpipev) several, built as separate chunks.

    Raises:
        TrainingError: the schedule, model provider, task or data provider cannot run a pipeline.
    """
    from d9d.mesh import get_logger
    from d9d.trainer.errors import TrainingError

    n = getattr(data, "microbatches_per_step", None)
    if n is None:
        raise TrainingError("mesh.pipeline_parallel > 1 needs a data provider with microbatches_per_step")
    layout = pipeline_layout(job, context.axis_size("pp"), int(n))
    stages = layout.stages_of_rank(context.coordinate("pp"))
    get_logger("d9d.trainer").info(
        "pipeline stages",
        schedule=job.config.pipelining.schedule,
        stages=[s.index for s in stages],
        layers=[f"{s.layers.start}..{s.layers.stop - 1}" for s in stages],
    )
    return layout, stages, int(n)
