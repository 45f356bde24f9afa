"""Pipeline parallelism: layer-to-stage planning, schedules by name, and a step over microbatches.

layout = plan_pipeline(num_layers, pp_size, PipelineConfig("zbv"), n_microbatches=8)
specs = layout.stages_of_rank(ctx.coordinate("pp"))        # build one module per spec
pipe = Pipeline(layout, modules, pp_group=ctx.mesh("dense")["pp"], n_microbatches=8, loss_fn=fn)
loss = pipe.step(inputs, targets)                           # summed loss on the last stage
"""

from d9d.parallel.pipeline.bubble import ZERO_BUBBLE_SCHEDULES, PipelineBubble, pipeline_bubble
from d9d.parallel.pipeline.chunks import StageChunks, merge_stage_modules
from d9d.parallel.pipeline.config import (
    PIPELINE_SCHEDULES,
    PipelineConfig,
    PipelineScheduleInfo,
    StageToRankStyle,
    check_pipeline_microbatches,
    pipeline_schedule_info,
)
from d9d.parallel.pipeline.errors import PipelineError
from d9d.parallel.pipeline.layout import (
    PipelineLayout,
    StageSpec,
    plan_pipeline,
    split_layers,
    stage_to_rank,
)
from d9d.parallel.pipeline.runtime import (
    Pipeline,
    PipelineLossFn,
    fsdp_reshard_after_forward,
    prepare_fsdp_for_schedule,
)
from d9d.parallel.pipeline.stage import PipelineStageModule, keep_stage_layers
from d9d.parallel.pipeline.tied import TiedParameters, declared_ties

__all__ = [
    "PIPELINE_SCHEDULES",
    "ZERO_BUBBLE_SCHEDULES",
    "Pipeline",
    "PipelineBubble",
    "PipelineConfig",
    "PipelineError",
    "PipelineLayout",
    "PipelineLossFn",
    "PipelineScheduleInfo",
    "PipelineStageModule",
    "StageChunks",
    "StageSpec",
    "StageToRankStyle",
    "TiedParameters",
    "check_pipeline_microbatches",
    "declared_ties",
    "fsdp_reshard_after_forward",
    "keep_stage_layers",
    "merge_stage_modules",
    "pipeline_bubble",
    "pipeline_schedule_info",
    "plan_pipeline",
    "prepare_fsdp_for_schedule",
    "split_layers",
    "stage_to_rank",
]
