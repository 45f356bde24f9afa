"""The model provider: build a stage on the meta device, shape it for the mesh, say how to export it;
and its optional abilities (mesh and sequence-length checks, pipeline stages, starting weights, a description)."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from d9d.mesh import DistributedContext, MeshConfig
from d9d.parallel import (
    ActivationCheckpointingConfig,
    AttentionKernel,
    CompileConfig,
    LoraConfig,
    LossConfig,
    MixedPrecision,
)


@dataclass(frozen=True)
class InitializeModelStageContext:
    """What `initialize_model_stage` may look at. It runs under `torch.device("meta")`.

    Attributes:
        context: where this rank sits (mesh, coordinates, device).
        stage_index: which pipeline stage to build (0 without pipeline parallelism).
        num_stages: pipeline stages in total (1 without pipeline parallelism).
        stage: with pipeline parallelism, the `d9d.parallel.pipeline.StageSpec` to build: the layers it
            holds (keep their whole-model names) and whether it is the first / last stage (embedding,
            final norm and head); None builds the whole model.
        base_dir: the config file's directory.
        precision: the job's resolved `trainer.precision` (compute and reduction dtypes). Build the
            model in float32 anyway: master weights stay float32 and the trainer casts the compute.
        attention: the plan's attention kernel (`trainer.attention.backend`), e.g. to pick the model's
            own attention implementation; None when no plan decided one.
    """

    context: DistributedContext
    stage_index: int = 0
    num_stages: int = 1
    stage: Any = None
    base_dir: Path = Path()
    precision: MixedPrecision = field(default_factory=MixedPrecision)
    attention: AttentionKernel | None = None


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
    tensor parallel → expert parallel → `apply_lora(model, lora)` (when set) → for a decoder,
    `d9d.parallel.parallelize_decoder(model, mesh, blocks=..., embedding=..., final_norm=..., head=...,
    activation_checkpointing=..., compile=..., precision=..., cpu_offload=...)`, which applies
    activation checkpointing and compile per block, then the FSDP units (each block, the embedding,
    the final norm with the head); any other model: `apply_activation_checkpointing(blocks, ...)` →
    `compile_blocks(blocks, compile)` → `parallelize_hsdp(model, mesh, blocks=blocks, ...)`.

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
        loss: `trainer.loss`: when `fused`, a causal LM may make its head compute the loss
            (`d9d.parallel.fuse_linear_cross_entropy`, before `parallelize_decoder`) and declare it
            (`d9d.trainer.providers.ComputesTokenLoss`); the built-in task then passes it the labels.
        attention: the plan's attention kernel: pass it to `d9d.parallel.apply_attention_kernel` so
            a model that computes attention itself (FlexAttention, document masks) follows it; the
            trainer restricts SDPA to it around every step itself. None when no plan decided one.
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
    loss: LossConfig = field(default_factory=LossConfig)
    attention: AttentionKernel | None = None

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
    `fresh`: model keys the folder does not hold, which keep their initialization (e.g. a
    classification head on a causal LM's folder).
    """

    folder: Any = None
    mapper: Any = None
    fresh: frozenset[str] = frozenset()


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
