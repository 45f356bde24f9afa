"""Provider protocols: the small extension points a user implements for a job.

Each method takes one context object and returns one result object, so both can grow without
breaking existing providers. A provider class is named in the config's `providers:` section and
constructed with one argument: its config section, converted into the class's `config_type` when it
declares one (else the raw mapping).

Optional abilities are declared, never probed: a provider has one when it implements the small
protocol of that ability (`ChecksMesh`, `ChecksSequenceLength`, `PipelineModelProvider`, `ImportsModelWeights`,
`PipelineTask`, `DeclaresBatching`, `DeclaresOptimizerStates`), and the planning module
(`d9d.trainer.plan_job`) asks with `isinstance`. So a user's provider with the same declarations gets
exactly the plan, the checks and the `d9d plan` output a built-in one gets.
"""

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from d9d.data import DataProvider, DeclaresDocumentMasking, DeclaresSeqLen, DeclaresVocabSize, Tokenizer
from d9d.mesh import DistributedContext, MeshConfig
from d9d.parallel import ActivationCheckpointingConfig, CompileConfig, LoraConfig, MixedPrecision

__all__ = [
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
    "undeclared_methods",
]


# ---------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class InitializeModelStageContext:
    """What `initialize_model_stage` may look at. It runs under `torch.device("meta")`.

    Attributes:
        context: where this rank sits (mesh, coordinates, device).
        stage_index: which pipeline stage to build (0 without pipeline parallelism).
        num_stages: pipeline stages in total (1 without pipeline parallelism).
        stage: with pipeline parallelism, the `d9d.parallel.StageSpec` to build: the layers it
            holds (keep their whole-model names) and whether it is the first / last stage (embedding,
            final norm and head); None builds the whole model.
        base_dir: the config file's directory.
        precision: the job's resolved `trainer.precision` (compute and reduction dtypes). Build the
            model in float32 anyway: master weights stay float32 and the trainer casts the compute.
    """

    context: DistributedContext
    stage_index: int = 0
    num_stages: int = 1
    stage: Any = None
    base_dir: Path = Path()
    precision: MixedPrecision = field(default_factory=MixedPrecision)


@dataclass(frozen=True)
class InitializeModelStageResult:
    """The module of this stage, built on the meta device (no memory is allocated yet).

    Its parameters are materialized on the rank's device after `parallelize_model_stage`, then
    `init_weights()` is called when the module has one (else `reset_parameters()` on each submodule).
    """

    model: nn.Module


@dataclass(frozen=True)
class ParallelizeModelStageContext:
    """What `parallelize_model_stage` receives: the meta-device model to shape for training in place.

    It is called on every mesh, one process included (then `mesh` is None and the `parallelize_*`
    functions of d9d.parallel leave the module as it is). The usual order, as torchtitan's:
    tensor parallel → expert parallel → `apply_lora(model, lora)` (when set) →
    `apply_activation_checkpointing(blocks,
    activation_checkpointing)` → `compile_blocks(blocks, compile)` → `parallelize_hsdp(model, mesh,
    blocks=blocks, precision=precision, cpu_offload=cpu_offload)`.

    Attributes:
        precision: the job's `trainer.precision`: pass it to `parallelize_*` (`precision=`) so FSDP2
            gathers parameters in the compute dtype. The trainer runs every forward under
            `d9d.parallel.precision_autocast` itself, so the dtypes are right on any mesh either way.
        activation_checkpointing: `trainer.activation_checkpointing`, for
            `d9d.parallel.apply_activation_checkpointing`.
        compile: `trainer.compile`, for `d9d.parallel.compile_blocks` (before `parallelize_*`).
        lora: `peft.lora`, or None: when set, call `d9d.parallel.apply_lora(model, lora)` after
            tensor/expert/context parallelism and before activation checkpointing, compile and
            `parallelize_hsdp` (the trainer refuses a LoRA job whose model got no adapters).
        cpu_offload: `trainer.memory.cpu_offload`: pass it to `parallelize_hsdp` / `parallelize_fsdp`
            (`cpu_offload=`) so every FSDP2 unit keeps its state on the host (the trainer refuses a
            job whose units do not).
    """

    context: DistributedContext
    model: nn.Module
    stage_index: int = 0
    num_stages: int = 1
    stage: Any = None
    base_dir: Path = Path()
    precision: MixedPrecision = field(default_factory=MixedPrecision)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    compile: CompileConfig = field(default_factory=CompileConfig)
    lora: LoraConfig | None = None
    cpu_offload: bool = False

    @property
    def mesh(self) -> DeviceMesh | None:
        """The job's `dense` device mesh; None for one process (local mode)."""
        return None if self.context.is_local else self.context.mesh("dense")


@dataclass(frozen=True)
class PrepareExportModelStageContext:
    """What `prepare_export_model_stage` receives."""

    context: DistributedContext
    model: nn.Module
    base_dir: Path = Path()


@dataclass(frozen=True)
class PrepareExportModelStageResult:
    """How to save this stage: a `d9d.ckpt` state mapper from module names to saved names.

    `mapper=None` saves the module's own state-dict names unchanged. `extra_files` (file name →
    text) are written next to the weights by the main process, e.g. a Hugging Face `config.json`.
    """

    mapper: Any = None
    extra_files: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PrepareImportModelStageContext:
    """What the optional `prepare_import_model_stage` receives: the model (stage).

    It is called on the parallelized model before it is materialized (on the meta device: the keys
    the folder fills are then allocated as the rank's shard and not initialized), and again on the
    materialized model to load; answer the same both times (it must not depend on the values).
    `base_dir` is the config file's directory, for resolving a relative folder.
    """

    context: DistributedContext
    model: nn.Module
    base_dir: Path = Path()


@dataclass(frozen=True)
class PrepareImportModelStageResult:
    """Where to load starting weights from: a safetensors folder (e.g. a Hugging Face checkpoint).

    `folder=None` keeps the freshly initialized weights. `mapper` maps the folder's keys to the
    model's (e.g. `hf_export_mapper.inverse()`); None when the names already match. On a pipeline
    stage it may map the whole model: the stage loads the keys it holds (`d9d.ckpt.SelectOutputs`).
    """

    folder: Any = None
    mapper: Any = None


@runtime_checkable
class ModelProvider(Protocol):
    """Builds, distributes and exports the model."""

    def initialize_model_stage(self, context: InitializeModelStageContext) -> InitializeModelStageResult:
        """Build this rank's model (stage) on the meta device."""
        ...

    def parallelize_model_stage(self, context: ParallelizeModelStageContext) -> None:
        """Apply the parallelisms the mesh asks for, checkpointing and compile (called on every mesh)."""
        ...

    def prepare_export_model_stage(
        self, context: PrepareExportModelStageContext
    ) -> PrepareExportModelStageResult:
        """Return the mapper `Trainer.export()` saves through."""
        ...

    # Optional abilities, each its own protocol below: `ChecksMesh`, `ChecksSequenceLength`,
    # `PipelineModelProvider`, `ImportsModelWeights`, `DescribesModel`.


@runtime_checkable
class ChecksMesh(Protocol):
    """A model provider that refuses mesh degrees its model cannot be split by (optional)."""

    def check_mesh(self, mesh: MeshConfig) -> None:
        """Raise ValueError naming the key when the model cannot be split by `mesh` (heads by tp,
        experts by ep, layers by pp); called before anything is built or written, and by `d9d plan`."""
        ...


@dataclass(frozen=True)
class CheckSequenceLengthContext:
    """What `check_sequence_length` may look at.

    Attributes:
        seq_len: the tokens per sample the job would train on (the dataset's, or `d9d plan --seq-len`).
        base_dir: the config file's directory (for a model folder named relative to it).
    """

    seq_len: int
    base_dir: Path = Path()


@runtime_checkable
class ChecksSequenceLength(Protocol):
    """A model provider that refuses sequence lengths its model cannot compute exactly (optional)."""

    def check_sequence_length(self, context: CheckSequenceLengthContext) -> None:
        """Raise ValueError naming the key when sequences of `context.seq_len` tokens would not be
        computed as the model's own code computes them (e.g. a sliding window shorter than the
        sequence); called with the plan's length before anything is built, and by `d9d plan`."""
        ...


@runtime_checkable
class DescribesModel(Protocol):
    """A model provider that says what it built, in the trainer's "job built" line (optional)."""

    def describe_model(self) -> Mapping[str, str]:
        """Fields for the "job built" line (e.g. {"backend": "reference", "architecture": "mistral"});
        called once the model is built."""
        ...


@runtime_checkable
class PipelineModelProvider(Protocol):
    """A model provider that can build one pipeline stage at a time (needed for mesh.pipeline_parallel > 1).

    `initialize_model_stage` then builds the stage of `context.stage` (its layers keep their
    whole-model names; the first stage holds the embedding, the last the final norm and head).
    """

    def pipeline_num_layers(self) -> int:
        """The number of layers the trainer splits into stages."""
        ...


@runtime_checkable
class ImportsModelWeights(Protocol):
    """A model provider that starts a run from a safetensors folder (e.g. a Hugging Face checkpoint)."""

    def prepare_import_model_stage(
        self, context: PrepareImportModelStageContext
    ) -> PrepareImportModelStageResult:
        """Name the folder (and its mapper) to load when the run has no checkpoint of its own yet."""
        ...


# ---------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class BuildDatasetContext:
    """What a dataset provider may look at (e.g. to let only local rank 0 prepare files)."""

    context: DistributedContext
    base_dir: Any


@dataclass(frozen=True)
class BuildDatasetResult:
    """A map-style dataset, the function that collates a list of its samples into a batch, and what
    the plan checks against the mesh and the model.

    Attributes:
        seq_len: tokens per sample, checked against context parallelism before the model is built;
            None when samples have no one length. When not given, the dataset's own `seq_len` (an
            int attribute: `d9d.data.DeclaresSeqLen`, as every d9d.data dataset has).
        vocab_size: every token id is below it, checked against the model's input embedding; None
            when unknown. When not given, the dataset's own (`d9d.data.DeclaresVocabSize`).
        document_masking: samples pack documents that must not attend to each other (they carry
            `position_ids` and `document_ids`), checked against context parallelism; None when
            unknown. When not given, the dataset's own (`d9d.data.DeclaresDocumentMasking`).
        tokenizer: the `d9d.data.Tokenizer` the samples were encoded with (`d9d generate` encodes
            prompts and decodes text with it); None when unknown. When not given, the dataset's own
            `tokenizer` attribute (d9d.data's text and chat datasets have one).
    """

    dataset: Any
    collate_fn: Callable[[list[Any]], Any] | None = None
    seq_len: int | None = None
    vocab_size: int | None = None
    document_masking: bool | None = None
    tokenizer: Tokenizer | None = None

    def __post_init__(self) -> None:
        if self.seq_len is None and isinstance(self.dataset, DeclaresSeqLen):
            object.__setattr__(self, "seq_len", _count(self.dataset.seq_len))
        if self.vocab_size is None and isinstance(self.dataset, DeclaresVocabSize):
            object.__setattr__(self, "vocab_size", _count(self.dataset.vocab_size))
        if self.document_masking is None and isinstance(self.dataset, DeclaresDocumentMasking):
            masking = self.dataset.document_masking
            object.__setattr__(self, "document_masking", masking if isinstance(masking, bool) else None)
        if self.tokenizer is None:
            found = getattr(self.dataset, "tokenizer", None)
            object.__setattr__(self, "tokenizer", found if isinstance(found, Tokenizer) else None)


def _count(value: object) -> int | None:
    """`value` when it is an int (a declared length or size), else None (nothing declared)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@runtime_checkable
class DatasetProvider(Protocol):
    """Builds the training dataset (the `dataset:` section is its config)."""

    def build_dataset(self, context: BuildDatasetContext) -> BuildDatasetResult:
        """Return the dataset."""
        ...


@dataclass(frozen=True)
class BuildDataProviderContext:
    """What a data-provider factory receives."""

    context: DistributedContext
    dataset: BuildDatasetResult | None
    pipeline_stages: Any = "all"


@runtime_checkable
class DataProviderFactory(Protocol):
    """Builds the data provider (the `data:` section is its config)."""

    def build_data_provider(self, context: BuildDataProviderContext) -> DataProvider[Any]:
        """Return the provider that yields each step's microbatches."""
        ...


@dataclass(frozen=True)
class Batching:
    """How a data provider batches each step, as its factory declares it (`DeclaresBatching`).

    Attributes:
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        microbatch_size: samples per microbatch.
        microbatches_per_step: microbatches each data-parallel rank runs per step.
        data_parallel: the data-parallel ranks the global batch is split over.
    """

    global_batch_size: int
    microbatch_size: int
    microbatches_per_step: int
    data_parallel: int


@runtime_checkable
class DeclaresBatching(Protocol):
    """A data-provider factory that says how it will batch, from the config alone (no data read).

    Needed for mesh.pipeline_parallel > 1 (the schedule is built for the microbatch count); `d9d plan`
    prints it, and the trainer logs it.
    """

    def batching(self, mesh: MeshConfig) -> Batching:
        """The batching on `mesh`; raise a `d9d.data.BatchSizeError` when the batch does not split."""
        ...


@runtime_checkable
class SupportsClose(Protocol):
    """A data provider with resources to release (worker threads, files) when the trainer closes."""

    def close(self) -> None:
        """Release them; called once."""
        ...


# ---------------------------------------------------------------------------------------- task


@dataclass(frozen=True)
class LossContext:
    """One microbatch to compute the loss of."""

    model: nn.Module
    batch: Any
    device: torch.device


@dataclass(frozen=True)
class LossResult:
    """The summed (not averaged) loss of a microbatch and how many units it sums over.

    The trainer divides by the step's global weight (e.g. all tokens of the global batch), so the
    gradient is the single-device gradient of the global batch whatever the mesh and microbatching.
    """

    loss_sum: torch.Tensor
    weight: float | torch.Tensor


@runtime_checkable
class Task(Protocol):
    """Turns a batch into a loss."""

    def batch_weight(self, batch: Any) -> float | torch.Tensor:
        """The weight a microbatch contributes to its step (known before the forward pass).

        Return a tensor rather than a Python number where computing it would read a tensor: the
        trainer sums the weights on the device and never waits for them.
        """
        ...

    def compute_loss(self, context: LossContext) -> LossResult:
        """Forward the model on the batch and return the summed loss."""
        ...

    # Optional, for pipeline parallelism: `PipelineTask`.


@runtime_checkable
class PipelineTask(Task, Protocol):
    """A task that can also run under pipeline parallelism (the pipeline runs the forward itself)."""

    def pipeline_inputs(self, batch: Any) -> tuple[Any, Any]:
        """(the first stage's input, the target given to `pipeline_loss`) of a microbatch."""
        ...

    def pipeline_loss(self, output: Any, target: Any) -> LossResult:
        """The summed loss of the last stage's `output` against `target`."""
        ...


# ---------------------------------------------------------------------------------------- optim


@runtime_checkable
class OptimizerProvider(Protocol):
    """Builds the optimizer (the `optimizer:` section is its config)."""

    def build_optimizer(self, named_parameters: Iterable[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        """Return an optimizer over the trainable parameters."""
        ...


@dataclass(frozen=True)
class OptimizerStates:
    """The optimizer tensors kept per trainable parameter, as an optimizer provider declares them.

    Attributes:
        per_parameter: state tensors of each parameter's shape (AdamW 2, SGD momentum 1).
        description: what they are, for `d9d plan` (e.g. "AdamW: exp_avg + exp_avg_sq").
        dtype: their dtype; None: the parameter's (float32 master weights). A provider that keeps
            them in bfloat16 declares `torch.bfloat16`, which `optimizer.state_dtype: bfloat16` needs.
    """

    per_parameter: int
    description: str
    dtype: torch.dtype | None = None


@runtime_checkable
class DeclaresOptimizerStates(Protocol):
    """An optimizer provider that says what state it keeps per parameter (for the memory estimate)."""

    def optimizer_states(self) -> OptimizerStates:
        """Its state tensors per trainable parameter, from the config alone."""
        ...


@runtime_checkable
class LRSchedulerProvider(Protocol):
    """Builds the learning-rate schedule (the `lr_scheduler:` section is its config)."""

    def build_lr_scheduler(
        self, optimizer: torch.optim.Optimizer, total_steps: int
    ) -> torch.optim.lr_scheduler.LRScheduler:
        """Return a scheduler stepped once per optimizer step."""
        ...


def undeclared_methods(instance: object, ability: type) -> list[str]:
    """The methods of `ability` (a protocol above) that `instance` has as attributes but not as methods.

    `isinstance(instance, ability)` only sees that the names exist; an attribute that happens to
    share a name (`self.batching = {...}`) is no declaration, and the trainer refuses it rather than
    call it (`d9d.trainer.job.resolve.resolve_job`).
    """
    if not isinstance(instance, ability):
        return []
    names = [name for name, value in vars(ability).items() if not name.startswith("_") and callable(value)]
    return [name for name in names if not callable(getattr(instance, name))]
