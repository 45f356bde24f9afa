"""The built-in model provider of the model d9d ships (`d9d.trainer:ReferenceModelProvider`): the
`model:` section is a `d9d.trainer.models.ReferenceModelConfig`; every parallelism d9d has applies, and
the export is a Hugging Face folder transformers loads (the architecture `hf_model_type` names).

    providers: {model: d9d.trainer:ReferenceModelProvider}
    model: {vocab_size: 257, hidden_size: 128, intermediate_size: 384, num_layers: 4,
            num_attention_heads: 4, num_key_value_heads: 2}
"""

import json

from torch import nn

from d9d.mesh import MeshConfig
from d9d.parallel import (
    apply_attention_kernel,
    apply_lora,
    fuse_linear_cross_entropy,
    fused_head_problem,
    parallelize_context_parallel,
    parallelize_decoder,
)
from d9d.trainer.models.config import ReferenceModelConfig, check_sequence_length
from d9d.trainer.models.heads import build_reference_model, check_head_export
from d9d.trainer.models.hf_config import to_hf_config
from d9d.trainer.models.hf_weights import ExpertLayout, hf_export_mapper
from d9d.trainer.models.parallelize import (
    apply_expert_parallel,
    apply_tensor_parallel,
    check_mesh,
    decoder_parts,
    trim_to_stage,
)
from d9d.trainer.providers.model import (
    CheckSequenceLengthContext,
    InitializeModelStageContext,
    InitializeModelStageResult,
    ParallelizeModelStageContext,
    PrepareExportModelStageContext,
    PrepareExportModelStageResult,
)

__all__ = ["ReferenceModelProvider", "parallelize_reference_model", "reference_export"]


class ReferenceModelProvider:
    """Builds the reference model of the `model:` section; tensor, expert and context parallel when the
    mesh asks, LoRA when `peft.lora` is set, then `parallelize_decoder` (activation checkpointing,
    compile, and DDP, FSDP or HSDP as the data-parallel degrees say)."""

    config_type = ReferenceModelConfig

    def __init__(self, config: ReferenceModelConfig) -> None:
        self.config = config

    def initialize_model_stage(self, context: InitializeModelStageContext) -> InitializeModelStageResult:
        model = build_reference_model(self.config)
        if context.stage is not None:  # pipeline parallel: keep this stage's part (on meta: free)
            trim_to_stage(model, context.stage)
        return InitializeModelStageResult(model=model)

    def pipeline_num_layers(self) -> int:
        return self.config.num_layers

    def check_mesh(self, mesh: MeshConfig) -> None:
        """Refuse degrees the model cannot be split by (heads by tp, experts by ep, layers by pp)."""
        check_mesh(self.config, mesh)

    def check_sequence_length(self, context: CheckSequenceLengthContext) -> None:
        """Refuse sequences longer than model.sliding_window (the model attends to the whole sequence)."""
        check_sequence_length(self.config, context.seq_len)

    def parallelize_model_stage(self, context: ParallelizeModelStageContext) -> None:
        """Called on every mesh, one process too (there context.mesh is None and FSDP does nothing)."""
        parallelize_reference_model(context.model, context)

    def prepare_export_model_stage(
        self, context: PrepareExportModelStageContext
    ) -> PrepareExportModelStageResult:
        check_head_export(context.model, self.config, whole=context.context.config.pipeline_parallel == 1)
        return reference_export(self.config)


def parallelize_reference_model(model: nn.Module, context: ParallelizeModelStageContext) -> None:
    """The reference model's parallelisms in their order: tensor → expert → context parallel (and the
    attention kernel) → LoRA → the fused head loss (`trainer.loss`, where the head is a plain linear) →
    per layer checkpointing and compile, then the FSDP units of `d9d.parallel.parallelize_decoder`."""
    ctx = context.context
    apply_tensor_parallel(model, ctx)  # mesh.tensor_parallel > 1
    apply_expert_parallel(model, ctx, context.precision)  # mesh.expert_parallel > 1 (MoE)
    parallelize_context_parallel(model, context.mesh)  # mesh.context_parallel > 1
    apply_attention_kernel(model, context.attention)  # trainer.attention.backend: flex, or SDPA for masks
    if context.lora is not None:  # peft.lora: adapters follow the TP layout, FSDP shards them below
        apply_lora(model, context.lora)
    if context.loss.fused and model.lm_head is not None and fused_head_problem(model.lm_head) is None:
        fuse_linear_cross_entropy(model.lm_head, chunk_size=context.loss.chunk_size)
    parallelize_decoder(
        model,
        context.mesh,
        blocks=list(model.model.layers.values()),
        **decoder_parts(model),  # the embedding, final norm and head this stage holds
        activation_checkpointing=context.activation_checkpointing,  # trainer.activation_checkpointing
        compile=context.compile,  # trainer.compile
        precision=context.precision,  # trainer.precision: FSDP gathers in the compute dtype
        cpu_offload=context.cpu_offload,  # trainer.memory.cpu_offload: FSDP2 keeps the state on the host
    )


def reference_export(
    config: ReferenceModelConfig, expert_layout: ExpertLayout = "per_expert"
) -> PrepareExportModelStageResult:
    """A Hugging Face folder: weights through `hf_export_mapper` and the matching config.json."""
    return PrepareExportModelStageResult(
        mapper=hf_export_mapper(config, expert_layout=expert_layout),
        extra_files={"config.json": json.dumps(to_hf_config(config), indent=2)},
    )
