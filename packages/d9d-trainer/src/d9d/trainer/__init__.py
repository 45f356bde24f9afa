"""d9d.trainer: the job config, provider protocols and the `Trainer` that runs a job.

    python train.py config.yaml            # train.py calls d9d.trainer.main()

A job names its providers by import path in `providers:`; the trainer builds the model on the meta
device, lets the model provider parallelize it, materializes and initializes it identically on any
mesh, then trains with loss-weighted gradient accumulation, checkpoints, resumes and exports.
"""

from d9d.trainer._materialize import ModelInitError, materialize_and_initialize
from d9d.trainer.build import check_model_mesh, check_parallelisms_applied, sequence_length_problem
from d9d.trainer.builtins import (
    IGNORE_INDEX,
    AutoDataProviderFactory,
    BuiltinLRSchedulerProvider,
    BuiltinOptimizerProvider,
    CausalLMTask,
    lr_multiplier,
    optimizer_kernels,
)
from d9d.trainer.config import (
    ActivationCheckpointingConfig,
    CheckpointingConfig,
    CompileConfig,
    DeterminismConfig,
    EvalConfig,
    ExportConfig,
    GradientClippingConfig,
    JobConfig,
    LoggingConfig,
    LRSchedulerConfig,
    OptimizerConfig,
    PeftConfig,
    PipeliningConfig,
    PrecisionConfig,
    ProfilingConfig,
    ProvidersConfig,
    RunConfig,
    ScheduleConfig,
    TimeoutsConfig,
    TrackingConfig,
    TrainerConfig,
)
from d9d.trainer.entry import main, run_job
from d9d.trainer.errors import PeerFailedError, RunLockedError, TrainingError
from d9d.trainer.evaluation import EvalResult
from d9d.trainer.failures import ErrorVerdict, verdict_of
from d9d.trainer.job import ResolvedJob, resolve_job
from d9d.trainer.loading import ConfigError, LoadedJob, apply_overrides, load_job_config, resolve_object
from d9d.trainer.metrics import device_peak_flops, model_flops_per_token
from d9d.trainer.providers import (
    BuildDataProviderContext,
    BuildDatasetContext,
    BuildDatasetResult,
    DataProviderFactory,
    DatasetProvider,
    InitializeModelStageContext,
    InitializeModelStageResult,
    LossContext,
    LossResult,
    LRSchedulerProvider,
    ModelProvider,
    OptimizerProvider,
    ParallelizeModelStageContext,
    PrepareExportModelStageContext,
    PrepareExportModelStageResult,
    PrepareImportModelStageContext,
    PrepareImportModelStageResult,
    Task,
)
from d9d.trainer.records import METRICS_FILE, StepRecords, read_metrics, truncate_metrics
from d9d.trainer.reporting import PEER_ERROR_GRACE_S, is_shared_by_every_rank, report_error
from d9d.trainer.run_lock import LOCK_FILE, RunLock
from d9d.trainer.signals import EXIT_INTERRUPTED, EXIT_PREEMPTED, INTERRUPTED_MESSAGE, StopRequests
from d9d.trainer.step import (
    MicrobatchStep,
    PipelineStep,
    StepOutput,
    StepSettings,
    TrainStep,
    pipeline_layout,
)
from d9d.trainer.timing import PHASES, StepPhases, StepTimer
from d9d.trainer.tracking import Tracker, Trackers
from d9d.trainer.trainer import Trainer, TrainResult
from d9d.trainer.watchdog import EXIT_STEP_TIMEOUT

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_PREEMPTED",
    "EXIT_STEP_TIMEOUT",
    "IGNORE_INDEX",
    "INTERRUPTED_MESSAGE",
    "LOCK_FILE",
    "METRICS_FILE",
    "PEER_ERROR_GRACE_S",
    "PHASES",
    "ActivationCheckpointingConfig",
    "AutoDataProviderFactory",
    "BuildDataProviderContext",
    "BuildDatasetContext",
    "BuildDatasetResult",
    "BuiltinLRSchedulerProvider",
    "BuiltinOptimizerProvider",
    "CausalLMTask",
    "CheckpointingConfig",
    "CompileConfig",
    "ConfigError",
    "DataProviderFactory",
    "DatasetProvider",
    "DeterminismConfig",
    "ErrorVerdict",
    "EvalConfig",
    "EvalResult",
    "ExportConfig",
    "GradientClippingConfig",
    "InitializeModelStageContext",
    "InitializeModelStageResult",
    "JobConfig",
    "LRSchedulerConfig",
    "LRSchedulerProvider",
    "LoadedJob",
    "LoggingConfig",
    "LossContext",
    "LossResult",
    "MicrobatchStep",
    "ModelInitError",
    "ModelProvider",
    "OptimizerConfig",
    "OptimizerProvider",
    "ParallelizeModelStageContext",
    "PeerFailedError",
    "PeftConfig",
    "PipelineStep",
    "PipeliningConfig",
    "PrecisionConfig",
    "PrepareExportModelStageContext",
    "PrepareExportModelStageResult",
    "PrepareImportModelStageContext",
    "PrepareImportModelStageResult",
    "ProfilingConfig",
    "ProvidersConfig",
    "ResolvedJob",
    "RunConfig",
    "RunLock",
    "RunLockedError",
    "ScheduleConfig",
    "StepOutput",
    "StepPhases",
    "StepRecords",
    "StepSettings",
    "StepTimer",
    "StopRequests",
    "Task",
    "TimeoutsConfig",
    "Tracker",
    "Trackers",
    "TrackingConfig",
    "TrainResult",
    "TrainStep",
    "Trainer",
    "TrainerConfig",
    "TrainingError",
    "apply_overrides",
    "check_model_mesh",
    "check_parallelisms_applied",
    "device_peak_flops",
    "is_shared_by_every_rank",
    "load_job_config",
    "lr_multiplier",
    "main",
    "materialize_and_initialize",
    "model_flops_per_token",
    "optimizer_kernels",
    "pipeline_layout",
    "read_metrics",
    "report_error",
    "resolve_job",
    "resolve_object",
    "run_job",
    "sequence_length_problem",
    "truncate_metrics",
    "verdict_of",
]
