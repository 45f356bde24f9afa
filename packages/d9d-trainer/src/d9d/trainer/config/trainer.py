"""The `trainer:` section of the job config: the run's name and schedule, checkpointing, resume,
logging, tracking, profiling, clipping, determinism, timeouts, callbacks, and the d9d.parallel
mechanisms' own configs (precision, memory, activation checkpointing, compile, attention)."""

import math
from typing import Any, Literal

import msgspec

from d9d.parallel import (
    ActivationCheckpointingConfig,
    AttentionConfig,
    CompileConfig,
    LossConfig,
    MemoryConfig,
    PrecisionConfig,
)
from d9d.trainer.config.base import Section

__all__ = [
    "EVAL_METRICS",
    "CallbackConfig",
    "CheckpointingConfig",
    "DeterminismConfig",
    "GradientClippingConfig",
    "KeepBestConfig",
    "LoggingConfig",
    "ProfilingConfig",
    "ResumeConfig",
    "RunConfig",
    "ScheduleConfig",
    "StragglersConfig",
    "TimeoutsConfig",
    "TrackingConfig",
    "TrainerConfig",
]


class RunConfig(Section):
    """Identity of a run: checkpoints live in `save_dir/name/`; the same name resumes."""

    name: str

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or "\x00" in self.name or self.name in (".", ".."):
            raise ValueError(f"trainer.run.name must be a plain directory name, got {self.name!r}")


class ScheduleConfig(Section):
    """How long to train."""

    total_steps: int

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ValueError(f"trainer.schedule.total_steps must be >= 1, got {self.total_steps}")


#: The metrics an eval records on its step (`EvalResult.record`) that a checkpoint's commit record
#: holds, so `keep_best` can rank by them.
EVAL_METRICS = ("eval_loss", "eval_perplexity")


class KeepBestConfig(Section):
    """`trainer.checkpointing.keep_best`: also keep the `count` best checkpoints by `metric`.

    `metric` is one of `EVAL_METRICS`: the last eval's value at (or before) the saved step, recorded in
    the checkpoint's commit record (`d9d.ckpt.KeepBest`). `mode`: `min` (lower is better) or `max`.
    """

    metric: str = "eval_loss"
    mode: str = "min"
    count: int = 1

    def __post_init__(self) -> None:
        if self.metric not in EVAL_METRICS:
            raise ValueError(
                f"trainer.checkpointing.keep_best.metric {self.metric!r} is never recorded in a checkpoint; "
                f"use one of {', '.join(EVAL_METRICS)}"
            )
        if self.mode not in ("min", "max"):
            raise ValueError(
                f"trainer.checkpointing.keep_best.mode must be min (lower is better) or max, got {self.mode!r}"
            )
        if self.count < 1:
            raise ValueError(
                f"trainer.checkpointing.keep_best.count must be >= 1 (or remove keep_best), got {self.count}"
            )


class CheckpointingConfig(Section):
    """Where and how often to save. `period_steps: 0` saves only at the end.

    `save_on_signal`: on SIGTERM (pre-emption) or Ctrl-C, every rank finishes its step, the job
    saves a checkpoint and exits with `EXIT_PREEMPTED`; false exits without saving. `verify_on_load`
    (default true): each rank checksums its share of a checkpoint's files while the load reads them
    (no measurable cost: `benchmarks/ckpt_io.py`) and a damaged file stops the job with one line
    naming it and the checkpoint to fall back to.
    """

    save_dir: str = "runs"
    period_steps: int = 0
    num_to_keep: int = 3
    async_save: bool = False
    save_on_signal: bool = True
    verify_on_load: bool = True
    keep_best: KeepBestConfig | None = None
    """Keep the best checkpoints by an eval metric next to the `num_to_keep` newest (never the latest)."""

    def __post_init__(self) -> None:
        if self.period_steps < 0:
            raise ValueError(f"trainer.checkpointing.period_steps must be >= 0, got {self.period_steps}")
        if self.num_to_keep < 1:
            raise ValueError(f"trainer.checkpointing.num_to_keep must be >= 1, got {self.num_to_keep}")


class ProfilingConfig(Section):
    """`trainer.profiling`: torch.profiler Chrome traces of steps `start_step .. start_step + active_steps - 1`.

    Each rank writes `<dir>/rank-<r>-step-<n>.json.gz` (default dir: `<run_dir>/profile`; a relative
    dir is relative to the config file). `memory_snapshot` (CUDA only): record the allocator's history
    over those steps and write `<dir>/rank-<r>-memory.pickle`, also on an out-of-memory error.
    `active_steps: 0` (the default) profiles nothing.
    """

    start_step: int = 1
    active_steps: int = 0
    dir: str | None = None
    memory_snapshot: bool = False

    def __post_init__(self) -> None:
        if self.start_step < 1:
            raise ValueError(
                f"trainer.profiling.start_step must be >= 1 (steps count from 1), got {self.start_step}"
            )
        if self.active_steps < 0:
            raise ValueError(f"trainer.profiling.active_steps must be >= 0, got {self.active_steps}")


class TrackingConfig(Section):
    """`trainer.tracking`: experiment trackers that receive every metrics.jsonl record (`d9d.trainer.observe.tracking`).

    `backends`: any of `jsonl` (metrics.jsonl, always written, listed or not), `tensorboard`, `wandb`
    and `mlflow`; each of the last three is an extra of d9d-trainer (`d9d-trainer[wandb]`). Rank 0
    writes. `project`: the W&B project and the MLflow experiment. `tensorboard_dir`: the event files
    (default `<run_dir>/tensorboard`). `wandb_mode`: `online`, `offline` (files only, `wandb sync`
    later) or null (W&B's own default: `WANDB_MODE`, else online); `wandb_entity`: the W&B team or
    user (null: the default one); `wandb_dir`: where W&B keeps its files (default `<run_dir>`).
    `mlflow_tracking_uri`: the MLflow store (default `file:<run_dir>/mlruns`). Relative dirs are
    relative to the config file.
    """

    backends: tuple[Literal["jsonl", "tensorboard", "wandb", "mlflow"], ...] = ("jsonl",)
    project: str = "d9d"
    tensorboard_dir: str | None = None
    wandb_mode: Literal["online", "offline"] | None = None
    wandb_entity: str | None = None
    wandb_dir: str | None = None
    mlflow_tracking_uri: str | None = None

    def __post_init__(self) -> None:
        repeated = sorted({b for b in self.backends if self.backends.count(b) > 1})
        if repeated:
            raise ValueError(f"trainer.tracking.backends names {', '.join(repeated)} more than once")
        if not self.project.strip():
            raise ValueError("trainer.tracking.project must not be empty")


class ResumeConfig(Section):
    """How a run resumes from its checkpoint.

    `reset_optimizer`: when the optimizer changed since the checkpoint (another `optimizer.name` or
    `providers.optimizer`), start the new optimizer fresh from the checkpoint's weights instead of
    refusing to resume (its state cannot be carried over). An unchanged optimizer always resumes with
    its state, so the setting may stay on.
    """

    reset_optimizer: bool = False


class StragglersConfig(Section):
    """`trainer.logging.stragglers`: warn when one rank's busy time per step (its time outside
    collective waits, `d9d.trainer.observe.stragglers`) stays above `ratio` × the median rank's for `steps`
    steps in a row."""

    ratio: float = 1.25
    steps: int = 20

    def __post_init__(self) -> None:
        if not (self.ratio > 1 and math.isfinite(self.ratio)):
            raise ValueError(
                f"trainer.logging.stragglers.ratio must be > 1 (1.25: 25% busier than the median rank), got {self.ratio}"
            )
        if self.steps < 1:
            raise ValueError(f"trainer.logging.stragglers.steps must be >= 1, got {self.steps}")


class LoggingConfig(Section):
    """Metric logging (rank 0) and the log output of every rank. `stragglers`: the slow-rank
    warning of a run of several ranks (null: none; the records still name each step's busiest rank)."""

    period_steps: int = 10
    log_dir: str | None = None
    format: Literal["console", "json"] = "console"
    level: str = "INFO"
    progress_bar: bool = True
    stragglers: StragglersConfig | None = StragglersConfig()

    def __post_init__(self) -> None:
        if self.period_steps < 1:
            raise ValueError(f"trainer.logging.period_steps must be >= 1, got {self.period_steps}")


class GradientClippingConfig(Section):
    """Clip the global gradient norm to `max_norm` (null: measure it, do not clip)."""

    max_norm: float | None = 1.0

    def __post_init__(self) -> None:
        if self.max_norm is not None and not (self.max_norm > 0 and math.isfinite(self.max_norm)):
            raise ValueError(
                f"trainer.gradient_clipping.max_norm must be > 0 and finite, or null (no clipping), got {self.max_norm}"
            )


class DeterminismConfig(Section):
    """Seed of model initialization (the same on every rank, so every mesh starts from one model) and
    of training's randomness: each step's data and each microbatch's dropout draw from streams derived
    from it per data-parallel rank and microbatch (`d9d.trainer.step.randomness`), so data-parallel
    ranks draw different masks, tensor-parallel ranks the same, and a resume draws what an
    uninterrupted run draws (docs/checkpointing.md, "Randomness").

    `init_device`: where weights are initialized, `auto` (the job's device: fast on GPUs) or `cpu`
    (slower on GPUs, but bit-identical initial weights across device types; CPU and CUDA random
    streams differ).
    """

    seed: int = 0
    init_device: Literal["auto", "cpu"] = "auto"


class TimeoutsConfig(Section):
    """Timeouts in seconds: generous while starting, short once steps run.

    `init_s` bounds start-up collectives (rendezvous, loading a checkpoint). `step_s` bounds one
    training step (data, forward/backward, optimizer) on a distributed run: past it, the step
    watchdog stops every rank and names the ranks that are stuck (see `d9d.trainer.faults.watchdog`).
    Checkpoint saves are not part of a step; they wait up to `init_s`.
    """

    init_s: float = 600.0
    step_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("init_s", "step_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"trainer.timeouts.{name} must be > 0 and finite (seconds), got {value}")


class CallbackConfig(Section):
    """One `trainer.callbacks` entry with a config: `{target: file.py:MyCallback, config: {...}}`.

    `target` is resolved like a provider (`package.module:Name` or `file.py:Name`, relative to the
    config file); the class is constructed with `config`, converted into its `config_type` when it
    declares one. A plain string entry is a target without a config.
    """

    target: str
    config: dict[str, Any] = msgspec.field(default_factory=dict)


class TrainerConfig(Section):
    """The `trainer:` section.

    `device`: `auto` (CUDA when usable, else CPU), `cuda` or `cpu`. `precision`, `memory`,
    `activation_checkpointing`, `compile` and `loss` (the LM head and cross-entropy fused over chunks
    of tokens, on by default) are the d9d.parallel mechanisms' own configs; the trainer passes them to
    the model provider (see `ParallelizeModelStageContext`). `attention` picks the attention kernel
    (`d9d.parallel.AttentionConfig`): the plan decides it, the steps run SDPA with it.

    `on_nonfinite`: a step whose loss or grad norm is not finite `stop`s the run (the last committed
    checkpoint stays the latest) or is `skip`ped: its gradients are dropped and weights and optimizer
    state stay as they were, while the LR schedule, which follows the step number, moves on (the
    run still ends where `total_steps` says, at the schedule's end).
    """

    run: RunConfig
    schedule: ScheduleConfig
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    resume: ResumeConfig = ResumeConfig()
    logging: LoggingConfig = LoggingConfig()
    gradient_clipping: GradientClippingConfig = GradientClippingConfig()
    determinism: DeterminismConfig = DeterminismConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    on_nonfinite: Literal["stop", "skip"] = "stop"
    device: Literal["auto", "cuda", "cpu"] = "auto"
    precision: PrecisionConfig = PrecisionConfig()
    memory: MemoryConfig = MemoryConfig()
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    compile: CompileConfig = CompileConfig()
    loss: LossConfig = LossConfig()
    attention: AttentionConfig = AttentionConfig()
    profiling: ProfilingConfig = ProfilingConfig()
    tracking: TrackingConfig = TrackingConfig()
    callbacks: list[str | CallbackConfig] = msgspec.field(default_factory=list)
    """`d9d.trainer.Callback` subclasses run at the points of the run, in order (see
    `d9d.trainer.callbacks`): `file.py:Name` or `{target: file.py:Name, config: {...}}`."""
