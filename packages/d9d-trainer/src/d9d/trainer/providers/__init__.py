"""d9d.trainer.providers: the contract a job's providers implement, the small extension points of a job.

    from d9d.trainer.providers import InitializeModelStageContext, InitializeModelStageResult

Each method takes one context object and returns one result object, so both can grow without
breaking existing providers. A provider class is named in the config's `providers:` section and
constructed with one argument: its config section, converted into the class's `config_type` when it
declares one (else the raw mapping). The built-in providers (`d9d.trainer:CausalLMTask`, ...)
implement the same contract.

Optional abilities are declared, never probed: a provider has one when it implements the small
protocol of that ability (`ChecksMesh`, `ChecksSequenceLength`, `PipelineModelProvider`,
`ImportsModelWeights`, `DescribesModel`, `PipelineTask`, `PipelineStageKwargs`, `PreparesSteps`, `PreparesRun`, `ReportsMetrics`, `ShapesBatch`, `DeclaresBatching`, `DeclaresOptimizerStates`,
`SupportsClose`), and the planner (`d9d.trainer.planning.plan_job`) asks with `isinstance`. So a
user's provider with the same declarations gets exactly the plan, the checks and the `d9d plan`
output a built-in one gets.
"""

from typing import TYPE_CHECKING

from d9d.mesh.lazy import lazy_face

if TYPE_CHECKING:  # the public names, listed once: `lazy_face` reads this block
    from d9d.trainer.providers.data import (
        Batching,
        BuildDataProviderContext,
        BuildDatasetContext,
        BuildDatasetResult,
        DataProviderFactory,
        DatasetProvider,
        DeclaresBatching,
        SupportsClose,
    )
    from d9d.trainer.providers.model import (
        CheckSequenceLengthContext,
        ChecksMesh,
        ChecksSequenceLength,
        DescribesModel,
        ImportsModelWeights,
        InitializeModelStageContext,
        InitializeModelStageResult,
        ModelProvider,
        ParallelizeModelStageContext,
        PipelineModelProvider,
        PrepareExportModelStageContext,
        PrepareExportModelStageResult,
        PrepareImportModelStageContext,
        PrepareImportModelStageResult,
    )
    from d9d.trainer.providers.optim import (
        DeclaresOptimizerStates,
        LRSchedulerProvider,
        OptimizerProvider,
        OptimizerStates,
    )
    from d9d.trainer.providers.task import (
        ComputesTokenLoss,
        LossContext,
        LossResult,
        PipelineStageKwargs,
        PipelineTask,
        PrepareRunContext,
        PreparesRun,
        PreparesSteps,
        PrepareStepContext,
        ReportsMetrics,
        ShapesBatch,
        Task,
        tensor_from_state,
        tensor_state,
    )

__all__, __getattr__, __dir__ = lazy_face(__name__, globals())
