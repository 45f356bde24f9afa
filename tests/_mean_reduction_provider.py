"""A deliberately broken quickstart model provider for the e2e mutation check: FSDP averages the
gradients over data-parallel ranks (torch's usual "mean") instead of summing them (d9d's contract:
the loss is already normalized by the global token count), so every gradient is 1/dp of the truth.

Named in a job as `providers.model=<this file>:MeanReductionModelProvider`; data-parallel meshes only.
"""

import importlib.util
import sys
from pathlib import Path

from d9d.parallel import parallelize_hsdp
from d9d.trainer import ParallelizeModelStageContext

_TRAIN = Path(__file__).resolve().parents[1] / "examples" / "quickstart" / "train.py"


def _quickstart_module():  # the quickstart's train.py, importable under its own name once
    name = "_d9d_tests_quickstart_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _TRAIN)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


class MeanReductionModelProvider(_quickstart_module().QuickstartModelProvider):
    """The quickstart model, parallelized with `gradient_reduction="mean"` (the bug under test)."""

    def parallelize_model_stage(self, context: ParallelizeModelStageContext) -> None:
        blocks = list(context.model.model.layers.values())
        parallelize_hsdp(
            context.model, context.mesh, blocks=blocks, precision=context.precision, gradient_reduction="mean"
        )
