"""d9d.parallel: data, tensor, expert and context parallelism, and the global gradient norm.

    from d9d.parallel import parallelize_hsdp
    parallelize_hsdp(model, mesh, shard_axis="dp_shard")   # DDP, FSDP or HSDP, by the mesh

A decoder-only transformer takes the standard sequence in one call, `parallelize_decoder` (activation
checkpointing, per-block compile, then one FSDP unit per block, one for the embedding and one for the
final norm with the LM head).

Also the per-block training mechanisms any loop can use: mixed precision (`precision_autocast`,
`precision=` of the parallelize functions, weights cast once per step: `weights_cast_once`),
activation checkpointing, in-place `torch.compile`, the LM head and its cross-entropy fused over
chunks of tokens (`linear_cross_entropy`, `fuse_linear_cross_entropy`), LoRA adapters (`apply_lora`,
exported in PEFT's layout), AdamW/SGD with bfloat16 states (`StateDtypeAdamW`, `StateDtypeSGD`), and
sleep and wake of the training state (`TrainingStateSleep`: the accelerator's memory for an inference
engine between RL steps).

See packages/d9d-parallel/README.md for the gradient-reduction contract.

Expert parallelism (`MoE`, `parallelize_expert_parallel`, ...) and pipeline parallelism (`Pipeline`,
`plan_pipeline`, `PipelineConfig`, ...) are faces of their own: `d9d.parallel.expert`,
`d9d.parallel.pipeline`.

The names load on first use (PEP 562): the config sections (`PrecisionConfig`, `LoraConfig`, ...) and
the errors import no torch, so a job's config is checked without it; everything else imports torch
when first used.
"""

from typing import TYPE_CHECKING

from d9d.mesh.lazy import lazy_face

if TYPE_CHECKING:  # the public names, listed once: `lazy_face` reads this block
    from d9d.parallel.activation_checkpointing import (
        apply_activation_checkpointing,
        checkpointed_blocks,
        op_checkpoint_policy,
    )
    from d9d.parallel.activation_memory import (
        SavedActivations,
        saved_activation_bytes,
        saved_activation_bytes_among,
    )
    from d9d.parallel.attention import (
        AttentionKernel,
        apply_attention_kernel,
        cuda_attention_facts,
        resolve_attention,
    )
    from d9d.parallel.compile import compile_blocks
    from d9d.parallel.config import (
        ActivationCheckpointingConfig,
        AttentionConfig,
        CompileConfig,
        Float8Config,
        LoraConfig,
        LossConfig,
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
        meta_attention_as,
        parallelize_context_parallel,
        recording_gathered_keys_values,
        sequence_length_problem,
    )
    from d9d.parallel.cp_balance import (
        attention_pairs_per_rank,
        balance_ratio,
        balanced_document_order,
        token_attention_pairs,
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
    from d9d.parallel.errors import ParallelizeError, SleepError, UnsupportedParallelismError
    from d9d.parallel.float8 import (
        Float8Selection,
        apply_float8,
        float8_gathered_weights,
        float8_linears,
        precompute_float8_scales,
        select_float8_linears,
    )
    from d9d.parallel.fused_loss import (
        LinearCrossEntropyHead,
        describe_fused_loss,
        fuse_linear_cross_entropy,
        fused_head_problem,
        linear_cross_entropy,
        set_head_reduction,
    )
    from d9d.parallel.gradient_norm import (
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
        lazily_merged_state,
        lora_detached,
        lora_disabled,
        lora_parameter_names,
        lora_parameters,
        lora_state_dict,
        merge_lora,
        merged_state_dict,
        peft_adapter_config,
        peft_key,
        peft_state_dict,
    )
    from d9d.parallel.lora_targets import LoraCoverage, MissedProjection, PatternCoverage, lora_coverage
    from d9d.parallel.optimizer_states import StateDtypeAdamW, StateDtypeSGD, optimizer_state_bytes
    from d9d.parallel.precision import (
        MixedPrecision,
        autocast_forward,
        enable_tf32,
        precision_autocast,
        resolve_precision,
        to_autocast_dtype,
    )
    from d9d.parallel.sleep import TrainingStateSleep
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
    from d9d.parallel.weight_casts import (
        WeightCasts,
        cast_linears_once,
        cast_once_parameters,
        cast_weight,
        weights_cast_once,
    )

__all__, __getattr__, __dir__ = lazy_face(__name__, globals(), subfaces=("expert", "pipeline"))
