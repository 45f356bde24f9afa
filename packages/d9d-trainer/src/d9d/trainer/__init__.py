"""d9d.trainer: the job config, provider protocols and the `Trainer` that runs a job.

    python train.py config.yaml            # train.py calls d9d.trainer.main()

A job names its providers by import path in `providers:`; `plan_job` decides what the job builds
(mesh layout, precision, batching, pipeline stages, sequence length, memory) from the config and the
providers' declared abilities, and the trainer builds from that plan: the model on the meta device,
parallelized by the model provider, materialized and initialized identically on any mesh; then it
trains with loss-weighted gradient accumulation, checkpoints, resumes and exports.

The names below are the whole public face. They load on first use (PEP 562), so importing one that
needs no torch (`read_metrics`) does not import torch: `d9d metrics` stays fast. The Hugging Face
backend, an optional extra, is its own subpackage: `d9d.trainer.hf:HFCausalLMProvider`.
"""

from typing import TYPE_CHECKING

from d9d.mesh.lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers see; at run time `__getattr__` imports these on first use
    from d9d.trainer.build.materialize import materialize_and_initialize
    from d9d.trainer.builtins import (
        AutoDataProviderFactory,
        BuiltinLRSchedulerProvider,
        BuiltinOptimizerProvider,
        CausalLMTask,
    )
    from d9d.trainer.callbacks import Callback, RunControl
    from d9d.trainer.config import JobConfig
    from d9d.trainer.entry import main, run_job
    from d9d.trainer.errors import TrainingError
    from d9d.trainer.generation import SamplingConfig, generate
    from d9d.trainer.job.load import ConfigError, ConfigPath, LoadedJob, load_job_config
    from d9d.trainer.job.resolve import ResolvedJob, resolve_job
    from d9d.trainer.observe.metrics_file import read_metrics
    from d9d.trainer.planning import (
        FIT_HEADROOM,
        FitPlan,
        JobPlan,
        Lever,
        MemoryPlan,
        PipelinePlan,
        SequencePlan,
        plan_fit,
        plan_job,
    )
    from d9d.trainer.prepared_data import MixtureSource, PreparedDataConfig, PreparedDataProvider
    from d9d.trainer.providers import (
        Batching,
        BuildDataProviderContext,
        BuildDatasetContext,
        BuildDatasetResult,
        CheckSequenceLengthContext,
        ChecksMesh,
        ChecksSequenceLength,
        DataProviderFactory,
        DatasetProvider,
        DeclaresBatching,
        DeclaresOptimizerStates,
        DescribesModel,
        ImportsModelWeights,
        InitializeModelStageContext,
        InitializeModelStageResult,
        LossContext,
        LossResult,
        LRSchedulerProvider,
        ModelProvider,
        OptimizerProvider,
        OptimizerStates,
        ParallelizeModelStageContext,
        PipelineModelProvider,
        PipelineTask,
        PrepareExportModelStageContext,
        PrepareExportModelStageResult,
        PrepareImportModelStageContext,
        PrepareImportModelStageResult,
        SupportsClose,
        Task,
    )
    from d9d.trainer.results import TrainResult
    from d9d.trainer.run.evaluation import EvalResult
    from d9d.trainer.trainer import Trainer

#: Module → the public names it defines (the run-time twin of the imports above; a test keeps them equal).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "builtins": (
        "AutoDataProviderFactory",
        "BuiltinLRSchedulerProvider",
        "BuiltinOptimizerProvider",
        "CausalLMTask",
    ),
    "callbacks": ("Callback", "RunControl"),
    "config": ("JobConfig",),
    "entry": ("main", "run_job"),
    "errors": ("TrainingError",),
    "run.evaluation": ("EvalResult",),
    "generation": ("SamplingConfig", "generate"),
    "job.resolve": ("ResolvedJob", "resolve_job"),
    "job.load": ("ConfigError", "ConfigPath", "LoadedJob", "load_job_config"),
    "build.materialize": ("materialize_and_initialize",),
    "observe.metrics_file": ("read_metrics",),
    "planning": (
        "FIT_HEADROOM",
        "FitPlan",
        "JobPlan",
        "Lever",
        "MemoryPlan",
        "PipelinePlan",
        "SequencePlan",
        "plan_fit",
        "plan_job",
    ),
    "prepared_data": ("MixtureSource", "PreparedDataConfig", "PreparedDataProvider"),
    "providers": (
        "Batching",
        "BuildDataProviderContext",
        "BuildDatasetContext",
        "BuildDatasetResult",
        "CheckSequenceLengthContext",
        "ChecksMesh",
        "ChecksSequenceLength",
        "DataProviderFactory",
        "DatasetProvider",
        "DeclaresBatching",
        "DeclaresOptimizerStates",
        "DescribesModel",
        "ImportsModelWeights",
        "InitializeModelStageContext",
        "InitializeModelStageResult",
        "LRSchedulerProvider",
        "LossContext",
        "LossResult",
        "ModelProvider",
        "OptimizerProvider",
        "OptimizerStates",
        "ParallelizeModelStageContext",
        "PipelineModelProvider",
        "PipelineTask",
        "PrepareExportModelStageContext",
        "PrepareExportModelStageResult",
        "PrepareImportModelStageContext",
        "PrepareImportModelStageResult",
        "SupportsClose",
        "Task",
    ),
    "results": ("TrainResult",),
    "trainer": ("Trainer",),
}
_MODULE_OF, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())  # PEP 562

__all__ = [
    "FIT_HEADROOM",
    "AutoDataProviderFactory",
    "Batching",
    "BuildDataProviderContext",
    "BuildDatasetContext",
    "BuildDatasetResult",
    "BuiltinLRSchedulerProvider",
    "BuiltinOptimizerProvider",
    "Callback",
    "CausalLMTask",
    "CheckSequenceLengthContext",
    "ChecksMesh",
    "ChecksSequenceLength",
    "ConfigError",
    "ConfigPath",
    "DataProviderFactory",
    "DatasetProvider",
    "DeclaresBatching",
    "DeclaresOptimizerStates",
    "DescribesModel",
    "EvalResult",
    "FitPlan",
    "ImportsModelWeights",
    "InitializeModelStageContext",
    "InitializeModelStageResult",
    "JobConfig",
    "JobPlan",
    "LRSchedulerProvider",
    "Lever",
    "LoadedJob",
    "LossContext",
    "LossResult",
    "MemoryPlan",
    "MixtureSource",
    "ModelProvider",
    "OptimizerProvider",
    "OptimizerStates",
    "ParallelizeModelStageContext",
    "PipelineModelProvider",
    "PipelinePlan",
    "PipelineTask",
    "PrepareExportModelStageContext",
    "PrepareExportModelStageResult",
    "PrepareImportModelStageContext",
    "PrepareImportModelStageResult",
    "PreparedDataConfig",
    "PreparedDataProvider",
    "ResolvedJob",
    "RunControl",
    "SamplingConfig",
    "SequencePlan",
    "SupportsClose",
    "Task",
    "TrainResult",
    "Trainer",
    "TrainingError",
    "generate",
    "load_job_config",
    "main",
    "materialize_and_initialize",
    "plan_fit",
    "plan_job",
    "read_metrics",
    "resolve_job",
    "run_job",
]
