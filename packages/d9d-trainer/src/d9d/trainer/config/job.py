"""The job config: one YAML file read into frozen msgspec structs, `JobConfig` at the top.

Sections owned by lower packages keep their own structs (`mesh:` is `d9d.mesh.MeshConfig`); the
sections a provider owns (`model:`, `dataset:`, `eval_dataset:`, and `data:` for a custom data provider) stay raw here
and are converted into the provider's own `config_type` when the providers are resolved, so every
unknown key and wrong type still fails before anything starts, with its key path.
"""

import math
from typing import Any, Literal

import msgspec

from d9d.mesh import MeshConfig
from d9d.parallel import LoraConfig
from d9d.trainer.config.base import Section
from d9d.trainer.config.trainer import TrainerConfig

__all__ = [
    "EarlyStoppingConfig",
    "EvalConfig",
    "ExportConfig",
    "JobConfig",
    "LRSchedulerConfig",
    "OptimizerConfig",
    "PeftConfig",
    "PipeliningConfig",
    "ProvidersConfig",
]


class ProvidersConfig(Section):
    """Import paths of the job's providers: `package.module:Name` or `file.py:Name`.

    A `file.py` path is resolved relative to the config file's directory.
    """

    model: str
    dataset: str | None = None
    eval_dataset: str | None = None
    """The validation set's dataset provider (its config is the `eval_dataset:` section); see `eval:`."""
    task: str = "d9d.trainer:CausalLMTask"
    data: str = "d9d.trainer:AutoDataProviderFactory"
    optimizer: str = "d9d.trainer:BuiltinOptimizerProvider"
    lr_scheduler: str = "d9d.trainer:BuiltinLRSchedulerProvider"


class OptimizerConfig(Section):
    """The built-in optimizers: AdamW and SGD.

    `implementation`: `auto` (fused kernels on CUDA, foreach on CPU), `fused`, `foreach` (one
    multi-tensor kernel per group) or `for_loop` (one parameter at a time).

    `state_dtype`: the dtype of the per-parameter states (AdamW's two moments, SGD's momentum).
    `bfloat16` halves their bytes (`d9d.parallel.StateDtypeAdamW` / `StateDtypeSGD`: torch's update
    in float32 chunks, the states rounded to nearest bfloat16 after it); the master weights stay
    float32. A checkpoint resumes across the setting (its states are cast on load). A custom
    `providers.optimizer` must declare bfloat16 states (`optimizer_states()`) to be given it.
    """

    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    momentum: float = 0.0
    implementation: Literal["auto", "fused", "foreach", "for_loop"] = "auto"
    state_dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"optimizer.lr must be > 0 and finite, got {self.lr}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"optimizer.eps must be > 0 and finite, got {self.eps}")
        for index, beta in enumerate(self.betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"optimizer.betas[{index}] must be in [0, 1), got {beta}")
        for name in ("weight_decay", "momentum"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"optimizer.{name} must be >= 0 and finite, got {value}")


class LRSchedulerConfig(Section):
    """Linear warmup from 0, then cosine or linear decay to `min_lr_ratio × lr`, constant, or `wsd`.

    `wsd` (warmup-stable-decay) holds the peak until its decay, which takes the last `decay_steps`
    steps of `total_steps` (null: the last `decay_ratio` of them) down to `min_lr_ratio`, along
    `decay_shape`: `linear`, or `1-sqrt` (1 − √progress: most of the drop early in the decay). The
    schedule is a function of (step, total_steps), so raising total_steps on resume recomputes it for
    the new total: `wsd` keeps its stable phase at the peak and moves the decay to the new end (from
    a checkpoint before the old decay: no jump); cosine and linear stretch their decay, so the
    learning rate moves to the new curve's value at the resumed step (from 0 at the end of a
    finished run to the middle of the new curve); constant does not change. Each is logged.
    """

    name: Literal["cosine", "linear", "constant", "wsd"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    decay_ratio: float = 0.1
    decay_steps: int | None = None
    decay_shape: Literal["linear", "1-sqrt"] = "linear"

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"lr_scheduler.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"lr_scheduler.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 < self.decay_ratio <= 1.0:
            raise ValueError(f"lr_scheduler.decay_ratio must be in (0, 1], got {self.decay_ratio}")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ValueError(
                f"lr_scheduler.decay_steps must be >= 1 (or null: the last decay_ratio of total_steps), "
                f"got {self.decay_steps}"
            )


class PipeliningConfig(Section):
    """Pipeline schedule by name (used when mesh.pipeline_parallel > 1).

    `stages_per_rank: null` takes the schedule's default. The embedding and the head count as
    `embedding_weight` / `head_weight` layers when layers are split into stages.
    """

    schedule: str = "1f1b"
    stages_per_rank: int | None = None
    embedding_weight: float = 1.0
    head_weight: float = 1.0

    def __post_init__(self) -> None:
        for name in ("embedding_weight", "head_weight"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"pipelining.{name} must be >= 0 and finite, got {value}")


class ExportConfig(Section):
    """Where `Trainer.export()` writes safetensors at the end of training (null: no export).

    `lora` (a run with `peft.lora`): "adapter" writes the adapters alone in PEFT's layout, "merged"
    the base model with the adapters folded in, through the provider's export mapper (e.g. a
    Hugging Face folder), "both" the two side by side in `dir/adapter` and `dir/merged`.
    """

    dir: str | None = None
    shard_size_mb: int = 2048
    lora: Literal["adapter", "merged", "both"] = "adapter"

    def __post_init__(self) -> None:
        if self.shard_size_mb <= 0:
            raise ValueError(
                f"export.shard_size_mb must be > 0 (megabytes per file), got {self.shard_size_mb}"
            )


class EarlyStoppingConfig(Section):
    """`eval.early_stopping`: stop (and save) once `eval_loss` has not improved by more than `min_delta` on
    the best so far for `patience` evals in a row (`d9d.trainer.run.early_stopping`)."""

    patience: int
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise ValueError(
                f"eval.early_stopping.patience must be >= 1 (evals without improvement), got {self.patience}"
            )
        if not self.min_delta >= 0:
            raise ValueError(f"eval.early_stopping.min_delta must be >= 0, got {self.min_delta}")


class EvalConfig(Section):
    """The validation loop: the mean token loss over `providers.eval_dataset`'s set (`d9d.trainer.run.evaluation`).

    `period_steps`: evaluate every N steps, and always after the last one (0: only after the last).
    `steps`: evaluate the first K microbatches of the set, in order (null: the whole set).
    `microbatch_size`: samples per eval forward on one rank (null: `data.microbatch_size`, else 1).
    """

    period_steps: int = 0
    steps: int | None = None
    microbatch_size: int | None = None
    early_stopping: EarlyStoppingConfig | None = None

    def __post_init__(self) -> None:
        if self.period_steps < 0:
            raise ValueError(
                f"eval.period_steps must be >= 0 (0: evaluate only after the last step), got {self.period_steps}"
            )
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"eval.steps must be >= 1, or null for the whole eval set, got {self.steps}")
        if self.microbatch_size is not None and self.microbatch_size < 1:
            raise ValueError(
                f"eval.microbatch_size must be >= 1, or null for data.microbatch_size, got {self.microbatch_size}"
            )


class PeftConfig(Section):
    """The `peft:` section: parameter-efficient fine-tuning (null `lora`: train every parameter).

    `lora` is `d9d.parallel.LoraConfig`; the trainer passes it to the model provider, whose
    `parallelize_model_stage` applies it (`d9d.parallel.apply_lora(model, context.lora)`).
    """

    lora: LoraConfig | None = None


class JobConfig(Section):
    """A whole job, as written in its YAML file."""

    providers: ProvidersConfig
    trainer: TrainerConfig
    data: dict[str, Any] = msgspec.field(default_factory=dict)
    mesh: MeshConfig = MeshConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    lr_scheduler: LRSchedulerConfig = LRSchedulerConfig()
    pipelining: PipeliningConfig = PipeliningConfig()
    model: dict[str, Any] = msgspec.field(default_factory=dict)
    dataset: dict[str, Any] = msgspec.field(default_factory=dict)
    eval: EvalConfig | None = None
    eval_dataset: dict[str, Any] = msgspec.field(default_factory=dict)
    export: ExportConfig = ExportConfig()
    peft: PeftConfig = PeftConfig()
    preference: dict[str, Any] = msgspec.field(default_factory=dict)
    """The preference task's section (`d9d.trainer:PreferenceTask`: `loss`, `beta`, ...)."""
    rl: dict[str, Any] = msgspec.field(default_factory=dict)
    """The RL task's section (`d9d.trainer:GRPOTask`: `reward`, `group_size`, ...)."""
    task: dict[str, Any] = msgspec.field(default_factory=dict)
    """A task's own section (a task class names the section it reads in `config_section`: `task`,
    `preference` or `rl`)."""
