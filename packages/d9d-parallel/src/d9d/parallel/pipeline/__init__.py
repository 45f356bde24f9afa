"""Pipeline parallelism: layer-to-stage planning, schedules by name, and a step over microbatches.

layout = plan_pipeline(num_layers, pp_size, PipelineConfig("zbv"), n_microbatches=8)
specs = layout.stages_of_rank(ctx.coordinate("pp"))        # build one module per spec
pipe = Pipeline(layout, modules, pp_group=ctx.mesh("dense")["pp"], n_microbatches=8, loss_fn=fn)
loss = pipe.step(inputs, targets)                           # summed loss on the last stage

The names load on first use (PEP 562): `PipelineConfig`, `PIPELINE_SCHEDULES` and `PipelineError`
import no torch, so a job's pipelining section is checked without it.
"""

from typing import TYPE_CHECKING

from d9d.mesh.lazy import lazy_face

if TYPE_CHECKING:  # the public names, listed once: `lazy_face` reads this block
    from d9d.parallel._torch_compat import zero_bubble_custom_function_problem
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

__all__, __getattr__, __dir__ = lazy_face(__name__, globals())
