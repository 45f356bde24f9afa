"""d9d.parallel: data, tensor and expert parallelism on DTensor, and the global gradient norm.

    from d9d.parallel import parallelize_hsdp
    parallelize_hsdp(model, mesh, shard_axis="dp_shard")   # DDP, FSDP or HSDP, by the mesh

See packages/d9d-parallel/README.md for the gradient-reduction contract.
"""

from d9d.parallel.data_parallel import (
    GradientReduction,
    apply_activation_checkpointing,
    parallelize_fsdp,
    parallelize_hsdp,
    parallelize_replicate,
    set_gradient_sync,
)
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
from d9d.parallel.grad_norm import clip_grad_norm_, grad_norm
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
    "AllToAllDispatcher",
    "ExpertParallelError",
    "GradientReduction",
    "GroupedExperts",
    "LoadBalanceStats",
    "LocalDispatcher",
    "MoE",
    "ParallelizeError",
    "ReplicateParallel",
    "RouterOutput",
    "TensorParallelPlan",
    "TokenDispatcher",
    "TopKRouter",
    "UnsupportedParallelismError",
    "apply_activation_checkpointing",
    "attention_plan",
    "clip_grad_norm_",
    "cross_entropy",
    "embedding_plan",
    "grad_norm",
    "lm_head_plan",
    "load_balance_stats",
    "loss_parallel",
    "mlp_plan",
    "moe_aux_loss",
    "norm_plan",
    "parallelize_expert_parallel",
    "parallelize_fsdp",
    "parallelize_hsdp",
    "parallelize_replicate",
    "parallelize_tensor_parallel",
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
    StageSpec,
    StageToRankStyle,
    check_pipeline_microbatches,
    fsdp_reshard_after_forward,
    keep_stage_layers,
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
    "StageSpec",
    "StageToRankStyle",
    "check_pipeline_microbatches",
    "fsdp_reshard_after_forward",
    "keep_stage_layers",
    "pipeline_schedule_info",
    "plan_pipeline",
    "prepare_fsdp_for_schedule",
    "split_layers",
    "stage_to_rank",
]
