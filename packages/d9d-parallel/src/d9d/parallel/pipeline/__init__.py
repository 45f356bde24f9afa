"""Pipeline parallelism: layer-to-stage planning, schedules by name, and a step over microbatches.

layout = plan_pipeline(num_layers, pp_size, PipelineConfig("zbv"), n_microbatches=8)
specs = layout.stages_of_rank(ctx.coordinate("pp"))        # build one module per spec
pipe = Pipeline(layout, modules, pp_group=ctx.mesh("dense")["pp"], n_microbatches=8, loss_fn=fn)
loss = pipe.step(inputs, targets)                           # summed loss on the last stage

The names load on first use (PEP 562): `PipelineConfig`, `PIPELINE_SCHEDULES` and `PipelineError`
import no torch, so a job's pipelining section is checked without it.
"""

from typing import TYPE_CHECKING

from d9d.mesh.lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers see; at run time `__getattr__` imports these on first use
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

#: Module → the public names it defines (the run-time twin of the imports above; a test keeps them equal).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "bubble": ("ZERO_BUBBLE_SCHEDULES", "PipelineBubble", "pipeline_bubble"),
    "chunks": ("StageChunks", "merge_stage_modules"),
    "config": (
        "PIPELINE_SCHEDULES",
        "PipelineConfig",
        "PipelineScheduleInfo",
        "StageToRankStyle",
        "check_pipeline_microbatches",
        "pipeline_schedule_info",
    ),
    "errors": ("PipelineError",),
    "layout": ("PipelineLayout", "StageSpec", "plan_pipeline", "split_layers", "stage_to_rank"),
    "runtime": ("Pipeline", "PipelineLossFn", "fsdp_reshard_after_forward", "prepare_fsdp_for_schedule"),
    "stage": ("PipelineStageModule", "keep_stage_layers"),
    "tied": ("TiedParameters", "declared_ties"),
}
_MODULE_OF, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())  # PEP 562

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
