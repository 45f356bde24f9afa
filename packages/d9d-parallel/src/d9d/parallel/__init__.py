"""d9d.parallel: data, tensor, expert and context parallelism, and the global gradient norm.

    from d9d.parallel import parallelize_hsdp
    parallelize_hsdp(model, mesh, shard_axis="dp_shard")   # DDP, FSDP or HSDP, by the mesh

Also the per-block training mechanisms any loop can use: mixed precision (`precision_autocast`,
`precision=` of the parallelize functions), activation checkpointing, in-place `torch.compile`, and
LoRA adapters (`apply_lora`, exported in PEFT's layout).

See packages/d9d-parallel/README.md for the gradient-reduction contract.
"""

from d9d.parallel.activation_checkpointing import (
    ActivationCheckpointingConfig,
    apply_activation_checkpointing,
    checkpointed_blocks,
)
from d9d.parallel.activation_memory import saved_activation_bytes
from d9d.parallel.compile import CompileConfig, compile_blocks
from d9d.parallel.context_parallel import (
    ContextParallel,
    context_parallel_attention,
    context_parallel_of,
    parallelize_context_parallel,
)
from d9d.parallel.data_parallel import (
    GradientReduction,
    parallelize_fsdp,
    parallelize_hsdp,
    parallelize_replicate,
    set_gradient_accumulation,
    set_gradient_sync,
)
from d9d.parallel.document_attention import DocumentAttentionBackend, DocumentMask, document_attention_backend
from d9d.parallel.errors import ParallelizeError, UnsupportedParallelismError
from d9d.parallel.expert import (
    AllToAllDispatcher,
    ExpertParallelError,
    GroupedExperts,
    LoadBalanceStats,
    LocalDispatcher,
    MoE,
    RouterOutput,
    TokenDispatcher,
    TopKRouter,
    load_balance_stats,
    moe_aux_loss,
    parallelize_expert_parallel,
)
from d9d.parallel.grad_norm import clip_grad_norm_, grad_norm, is_tied_copy, register_tied_copy
from d9d.parallel.lora import (
    LoraA,
    LoraB,
    LoraConfig,
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
from d9d.parallel.precision import (
    MixedPrecision,
    PrecisionConfig,
    autocast_forward,
    enable_tf32,
    precision_autocast,
    resolve_precision,
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

__all__ = [
    "ActivationCheckpointingConfig",
    "AllToAllDispatcher",
    "CompileConfig",
    "ContextParallel",
    "DocumentAttentionBackend",
    "DocumentMask",
    "ExpertParallelError",
    "GradientReduction",
    "GroupedExperts",
    "LoadBalanceStats",
    "LocalDispatcher",
    "LoraA",
    "LoraB",
    "LoraConfig",
    "LoraError",
    "MixedPrecision",
    "MoE",
    "ParallelizeError",
    "PrecisionConfig",
    "ReplicateParallel",
    "RouterOutput",
    "TensorParallelPlan",
    "TokenDispatcher",
    "TopKRouter",
    "UnsupportedParallelismError",
    "apply_activation_checkpointing",
    "apply_lora",
    "attention_plan",
    "autocast_forward",
    "checkpointed_blocks",
    "clip_grad_norm_",
    "compile_blocks",
    "context_parallel_attention",
    "context_parallel_of",
    "cross_entropy",
    "document_attention_backend",
    "embedding_plan",
    "enable_tf32",
    "grad_norm",
    "is_tied_copy",
    "lm_head_plan",
    "load_balance_stats",
    "lora_detached",
    "lora_parameter_names",
    "lora_parameters",
    "lora_state_dict",
    "loss_parallel",
    "merge_lora",
    "merged_state_dict",
    "mlp_plan",
    "moe_aux_loss",
    "norm_plan",
    "parallelize_context_parallel",
    "parallelize_expert_parallel",
    "parallelize_fsdp",
    "parallelize_hsdp",
    "parallelize_replicate",
    "parallelize_tensor_parallel",
    "peft_adapter_config",
    "peft_key",
    "peft_state_dict",
    "precision_autocast",
    "resolve_precision",
    "saved_activation_bytes",
    "set_gradient_accumulation",
    "set_gradient_sync",
]

# Pipeline parallelism (d9d.parallel.pipeline): layer-to-stage plans, schedules by name, the step.
from d9d.parallel.pipeline import (
    PIPELINE_SCHEDULES,
    Pipeline,
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
    pipeline_schedule_info,
    plan_pipeline,
    prepare_fsdp_for_schedule,
    split_layers,
    stage_to_rank,
)

__all__ += [
    "PIPELINE_SCHEDULES",
    "Pipeline",
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
    "pipeline_schedule_info",
    "plan_pipeline",
    "prepare_fsdp_for_schedule",
    "register_tied_copy",
    "split_layers",
    "stage_to_rank",
]
