"""d9d.parallel: data, tensor, expert and context parallelism, and the global gradient norm.

    from d9d.parallel import parallelize_hsdp
    parallelize_hsdp(model, mesh, shard_axis="dp_shard")   # DDP, FSDP or HSDP, by the mesh

A decoder-only transformer takes the standard sequence in one call, `parallelize_decoder` (activation
checkpointing, per-block compile, then one FSDP unit per block, one for the embedding and one for the
final norm with the LM head).

Also the per-block training mechanisms any loop can use: mixed precision (`precision_autocast`,
`precision=` of the parallelize functions), activation checkpointing, in-place `torch.compile`, and
LoRA adapters (`apply_lora`, exported in PEFT's layout), and AdamW/SGD with bfloat16 states
(`StateDtypeAdamW`, `StateDtypeSGD`).

See packages/d9d-parallel/README.md for the gradient-reduction contract.

The names load on first use (PEP 562): the config sections (`PrecisionConfig`, `LoraConfig`,
`PipelineConfig`, ...), the schedule table and the errors import no torch, so a job's config is
checked without it; everything else imports torch when first used.
"""

import sys
import types
from typing import TYPE_CHECKING, Any

from d9d.mesh.lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers see; at run time `__getattr__` imports these on first use
    from d9d.parallel.activation_checkpointing import (
        apply_activation_checkpointing,
        checkpointed_blocks,
    )
    from d9d.parallel.activation_memory import saved_activation_bytes
    from d9d.parallel.compile import compile_blocks
    from d9d.parallel.config import (
        ActivationCheckpointingConfig,
        CompileConfig,
        Float8Config,
        LoraConfig,
        MemoryConfig,
        PrecisionConfig,
    )
    from d9d.parallel.context_parallel import (
        ContextParallel,
        SequenceLengthError,
        SequenceShare,
        check_sequence_length,
        context_parallel_attention,
        context_parallel_of,
        parallelize_context_parallel,
        sequence_length_problem,
    )
    from d9d.parallel.data_parallel import (
        GradientReduction,
        ShardUnit,
        fsdp_parameters,
        parallelize_fsdp,
        parallelize_hsdp,
        parallelize_replicate,
        set_gradient_accumulation,
        set_gradient_sync,
    )
    from d9d.parallel.decoder import decoder_units, parallelize_decoder
    from d9d.parallel.document_attention import (
        DocumentAttentionBackend,
        DocumentMask,
        document_attention_backend,
    )
    from d9d.parallel.errors import ParallelizeError, UnsupportedParallelismError
    from d9d.parallel.expert import (
        AllToAllDispatcher,
        ExpertParallelError,
        GroupedExperts,
        LoadBalanceStats,
        LocalDispatcher,
        MoE,
        MoEBalancing,
        RouterOutput,
        TokenDispatcher,
        TopKRouter,
        expert_load_summary,
        expert_loads,
        load_balance_stats,
        moe_aux_loss,
        moe_layers,
        moe_regularization_loss,
        moe_score_bias_names,
        parallelize_expert_parallel,
        update_expert_biases,
    )
    from d9d.parallel.float8 import Float8Selection, apply_float8, float8_linears, select_float8_linears
    from d9d.parallel.grad_norm import (
        clip_grad_norm_,
        grad_norm,
        is_tied_copy,
        reduce_partial_grads,
        register_tied_copy,
    )
    from d9d.parallel.lora import (
        LoraA,
        LoraB,
        LoraError,
        apply_lora,
        lora_detached,
        lora_parameter_names,
        lora_parameters,
        lora_state_dict,
        merge_lora,
        merged_state_dict,
        peft_adapter_config,
        peft_key,
        peft_state_dict,
    )
    from d9d.parallel.optimizer_states import StateDtypeAdamW, StateDtypeSGD, optimizer_state_bytes
    from d9d.parallel.pipeline import (
        PIPELINE_SCHEDULES,
        ZERO_BUBBLE_SCHEDULES,
        Pipeline,
        PipelineBubble,
        PipelineConfig,
        PipelineError,
        PipelineLayout,
        PipelineLossFn,
        PipelineScheduleInfo,
        PipelineStageModule,
        StageChunks,
        StageSpec,
        StageToRankStyle,
        check_pipeline_microbatches,
        fsdp_reshard_after_forward,
        keep_stage_layers,
        merge_stage_modules,
        pipeline_bubble,
        pipeline_schedule_info,
        plan_pipeline,
        prepare_fsdp_for_schedule,
        split_layers,
        stage_to_rank,
    )
    from d9d.parallel.precision import (
        MixedPrecision,
        autocast_forward,
        enable_tf32,
        precision_autocast,
        resolve_precision,
        to_autocast_dtype,
    )
    from d9d.parallel.tensor_parallel import (
        ReplicateParallel,
        TensorParallelPlan,
        attention_plan,
        cross_entropy,
        embedding_plan,
        lm_head_plan,
        loss_parallel,
        mlp_plan,
        norm_plan,
        parallelize_tensor_parallel,
    )

#: Module → the public names it defines (the run-time twin of the imports above; a test keeps them equal).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "activation_checkpointing": (
        "apply_activation_checkpointing",
        "checkpointed_blocks",
    ),
    "activation_memory": ("saved_activation_bytes",),
    "compile": ("compile_blocks",),
    "config": (
        "ActivationCheckpointingConfig",
        "CompileConfig",
        "Float8Config",
        "LoraConfig",
        "MemoryConfig",
        "PrecisionConfig",
    ),
    "context_parallel": (
        "ContextParallel",
        "SequenceLengthError",
        "SequenceShare",
        "check_sequence_length",
        "context_parallel_attention",
        "context_parallel_of",
        "parallelize_context_parallel",
        "sequence_length_problem",
    ),
    "data_parallel": (
        "GradientReduction",
        "ShardUnit",
        "fsdp_parameters",
        "parallelize_fsdp",
        "parallelize_hsdp",
        "parallelize_replicate",
        "set_gradient_accumulation",
        "set_gradient_sync",
    ),
    "decoder": ("decoder_units", "parallelize_decoder"),
    "document_attention": ("DocumentAttentionBackend", "DocumentMask", "document_attention_backend"),
    "errors": ("ParallelizeError", "UnsupportedParallelismError"),
    "float8": ("Float8Selection", "apply_float8", "float8_linears", "select_float8_linears"),
    "expert": (
        "AllToAllDispatcher",
        "ExpertParallelError",
        "GroupedExperts",
        "LoadBalanceStats",
        "LocalDispatcher",
        "MoE",
        "MoEBalancing",
        "RouterOutput",
        "TokenDispatcher",
        "TopKRouter",
        "expert_load_summary",
        "expert_loads",
        "load_balance_stats",
        "moe_aux_loss",
        "moe_layers",
        "moe_regularization_loss",
        "moe_score_bias_names",
        "parallelize_expert_parallel",
        "update_expert_biases",
    ),
    "grad_norm": (
        "clip_grad_norm_",
        "grad_norm",
        "is_tied_copy",
        "reduce_partial_grads",
        "register_tied_copy",
    ),
    "lora": (
        "LoraA",
        "LoraB",
        "LoraError",
        "apply_lora",
        "lora_detached",
        "lora_parameter_names",
        "lora_parameters",
        "lora_state_dict",
        "merge_lora",
        "merged_state_dict",
        "peft_adapter_config",
        "peft_key",
        "peft_state_dict",
    ),
    "optimizer_states": ("StateDtypeAdamW", "StateDtypeSGD", "optimizer_state_bytes"),
    "precision": (
        "MixedPrecision",
        "autocast_forward",
        "enable_tf32",
        "precision_autocast",
        "resolve_precision",
        "to_autocast_dtype",
    ),
    "tensor_parallel": (
        "ReplicateParallel",
        "TensorParallelPlan",
        "attention_plan",
        "cross_entropy",
        "embedding_plan",
        "lm_head_plan",
        "loss_parallel",
        "mlp_plan",
        "norm_plan",
        "parallelize_tensor_parallel",
    ),
    "pipeline": (
        "PIPELINE_SCHEDULES",
        "ZERO_BUBBLE_SCHEDULES",
        "Pipeline",
        "PipelineBubble",
        "PipelineConfig",
        "PipelineError",
        "PipelineLayout",
        "PipelineLossFn",
        "PipelineScheduleInfo",
        "PipelineStageModule",
        "StageChunks",
        "StageSpec",
        "StageToRankStyle",
        "check_pipeline_microbatches",
        "fsdp_reshard_after_forward",
        "keep_stage_layers",
        "merge_stage_modules",
        "pipeline_bubble",
        "pipeline_schedule_info",
        "plan_pipeline",
        "prepare_fsdp_for_schedule",
        "split_layers",
        "stage_to_rank",
    ),
}
_MODULE_OF, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())  # PEP 562

__all__ = [
    "PIPELINE_SCHEDULES",
    "ZERO_BUBBLE_SCHEDULES",
    "ActivationCheckpointingConfig",
    "AllToAllDispatcher",
    "CompileConfig",
    "ContextParallel",
    "DocumentAttentionBackend",
    "DocumentMask",
    "ExpertParallelError",
    "Float8Config",
    "Float8Selection",
    "GradientReduction",
    "GroupedExperts",
    "LoadBalanceStats",
    "LocalDispatcher",
    "LoraA",
    "LoraB",
    "LoraConfig",
    "LoraError",
    "MemoryConfig",
    "MixedPrecision",
    "MoE",
    "MoEBalancing",
    "ParallelizeError",
    "Pipeline",
    "PipelineBubble",
    "PipelineConfig",
    "PipelineError",
    "PipelineLayout",
    "PipelineLossFn",
    "PipelineScheduleInfo",
    "PipelineStageModule",
    "PrecisionConfig",
    "ReplicateParallel",
    "RouterOutput",
    "SequenceLengthError",
    "SequenceShare",
    "ShardUnit",
    "StageChunks",
    "StageSpec",
    "StageToRankStyle",
    "StateDtypeAdamW",
    "StateDtypeSGD",
    "TensorParallelPlan",
    "TokenDispatcher",
    "TopKRouter",
    "UnsupportedParallelismError",
    "apply_activation_checkpointing",
    "apply_float8",
    "apply_lora",
    "attention_plan",
    "autocast_forward",
    "check_pipeline_microbatches",
    "check_sequence_length",
    "checkpointed_blocks",
    "clip_grad_norm_",
    "compile_blocks",
    "context_parallel_attention",
    "context_parallel_of",
    "cross_entropy",
    "decoder_units",
    "document_attention_backend",
    "embedding_plan",
    "enable_tf32",
    "expert_load_summary",
    "expert_loads",
    "float8_linears",
    "fsdp_parameters",
    "fsdp_reshard_after_forward",
    "grad_norm",
    "is_tied_copy",
    "keep_stage_layers",
    "lm_head_plan",
    "load_balance_stats",
    "lora_detached",
    "lora_parameter_names",
    "lora_parameters",
    "lora_state_dict",
    "loss_parallel",
    "merge_lora",
    "merge_stage_modules",
    "merged_state_dict",
    "mlp_plan",
    "moe_aux_loss",
    "moe_layers",
    "moe_regularization_loss",
    "moe_score_bias_names",
    "norm_plan",
    "optimizer_state_bytes",
    "parallelize_context_parallel",
    "parallelize_decoder",
    "parallelize_expert_parallel",
    "parallelize_fsdp",
    "parallelize_hsdp",
    "parallelize_replicate",
    "parallelize_tensor_parallel",
    "peft_adapter_config",
    "peft_key",
    "peft_state_dict",
    "pipeline_bubble",
    "pipeline_schedule_info",
    "plan_pipeline",
    "precision_autocast",
    "prepare_fsdp_for_schedule",
    "reduce_partial_grads",
    "register_tied_copy",
    "resolve_precision",
    "saved_activation_bytes",
    "select_float8_linears",
    "sequence_length_problem",
    "set_gradient_accumulation",
    "set_gradient_sync",
    "split_layers",
    "stage_to_rank",
    "to_autocast_dtype",
    "update_expert_biases",
]


class _PublicFace(types.ModuleType):
    """Keeps a public name that is also a submodule's name bound to the public object.

    `grad_norm` is a function of the submodule `grad_norm`; whoever imports that submodule first
    (this package's `__getattr__` or any `from d9d.parallel.grad_norm import ...`), the import system
    then binds the submodule itself as `d9d.parallel.grad_norm`, which would hide the function.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            isinstance(value, types.ModuleType)
            and name in _MODULE_OF
            and value.__name__ == f"{__name__}.{name}"
        ):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _PublicFace
