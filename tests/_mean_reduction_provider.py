"""A deliberately broken quickstart model provider for the e2e mutation check: FSDP averages the
gradients over data-parallel ranks (torch's usual "mean") instead of summing them (d9d's contract:
the loss is already normalized by the global token count), so every gradient is 1/dp of the truth.

Named in a job as `providers.model=<this file>:MeanReductionModelProvider`; data-parallel meshes only.
"""

from _quickstart import quickstart_train_module

from d9d.parallel import parallelize_hsdp
from d9d.trainer.providers import ParallelizeModelStageContext


class MeanReductionModelProvider(quickstart_train_module().QuickstartModelProvider):
    """The quickstart model, parallelized with `gradient_reduction="mean"` (the bug under test)."""

    def parallelize_model_stage(self, context: ParallelizeModelStageContext) -> None:
        blocks = list(context.model.model.layers.values())
        parallelize_hsdp(
            context.model, context.mesh, blocks=blocks, precision=context.precision, gradient_reduction="mean"
        )
