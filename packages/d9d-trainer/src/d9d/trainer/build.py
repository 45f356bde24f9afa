"""Building a job's model: initialize on the meta device, shape it for training (parallelisms,
activation checkpointing, compile), then materialize and initialize it identically on any mesh."""

from typing import Any

from torch import nn

from d9d.mesh import D9dError, DistributedContext
from d9d.parallel import MixedPrecision, PipelineLayout, StageSpec
from d9d.trainer._materialize import materialize_and_initialize
from d9d.trainer.errors import TrainingError
from d9d.trainer.job import ResolvedJob
from d9d.trainer.providers import InitializeModelStageContext, ParallelizeModelStageContext

__all__ = ["build_model"]


def build_model(
    job: ResolvedJob,
    context: DistributedContext,
    precision: MixedPrecision,
    *,
    layout: PipelineLayout | None = None,
    stage: StageSpec | None = None,
) -> nn.Module:
    """This rank's model (stage): built on meta, parallelized by its provider, then materialized.

    Raises:
        TrainingError: the provider's parallelization renamed parameters (`torch.compile(module)`
            wraps it as `_orig_mod`), which would change every checkpoint and export key.
    """
    import torch

    config = job.config
    tcfg = config.trainer
    where: dict[str, Any] = {
        "stage_index": stage.index if stage is not None else 0,
        "num_stages": layout.num_stages if layout is not None else 1,
        "stage": stage,
        "base_dir": job.loaded.base_dir,
    }
    with torch.device("meta"):
        model = job.model_provider.initialize_model_stage(
            InitializeModelStageContext(context=context, precision=precision, **where)
        ).model
    try:
        job.model_provider.parallelize_model_stage(
            ParallelizeModelStageContext(
                context=context,
                model=model,
                precision=precision,
                activation_checkpointing=tcfg.activation_checkpointing,
                compile=tcfg.compile,
                **where,
            )
        )
    except D9dError as exc:
        if context.is_local and "no device mesh in local mode" in str(exc):
            raise TrainingError(
                "the model provider's parallelize_model_stage asked for a device mesh on one process: it "
                "is called on every mesh now; pass context.mesh (None on one process) to parallelize_hsdp "
                "instead of context.context.mesh('dense'), or check context.context.is_local"
            ) from exc
        raise
    renamed = [name for name, _ in model.named_parameters() if "_orig_mod." in name]
    if renamed:
        raise TrainingError(
            f"the model provider's parallelize_model_stage renamed parameters (e.g. {renamed[0]!r}): "
            "torch.compile(module) wraps the module; compile in place with module.compile() or "
            "d9d.parallel.compile_blocks so checkpoint and export keys stay the same"
        )
    init_device = "cpu" if tcfg.determinism.init_device == "cpu" else context.device
    materialize_and_initialize(model, context.device, tcfg.determinism.seed, init_device=init_device)
    return model
