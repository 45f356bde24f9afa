"""How the reference model is distributed: tensor- and expert-parallel plans for its modules.

Activation checkpointing, compile and data parallelism (`d9d.parallel.parallelize_decoder`, on the
modules `decoder_parts` names) are applied by the caller afterwards, so a provider reads: tensor
parallel → expert parallel → context parallel → LoRA → `parallelize_decoder`.
"""

from torch import nn
from torch.distributed.tensor import Shard

from d9d.mesh import DistributedContext, MeshConfig
from d9d.parallel import (
    MixedPrecision,
    ReplicateParallel,
    ShardUnit,
    TensorParallelPlan,
    attention_plan,
    decoder_units,
    embedding_plan,
    lm_head_plan,
    mlp_plan,
    norm_plan,
    parallelize_tensor_parallel,
)
from d9d.parallel.expert import MoE, parallelize_expert_parallel
from d9d.parallel.pipeline import StageSpec, keep_stage_layers
from d9d.trainer.models.config import ReferenceModelConfig
from d9d.trainer.models.heads import ReferenceWithHead
from d9d.trainer.models.model import ReferenceForCausalLM

__all__ = [
    "apply_expert_parallel",
    "apply_tensor_parallel",
    "check_mesh",
    "decoder_parts",
    "shard_units",
    "tensor_parallel_plan",
    "trim_to_stage",
]


def check_mesh(config: ReferenceModelConfig, mesh: MeshConfig) -> None:
    """Refuse mesh degrees this model's shape cannot be split by, before anything is built or written.

    Raises:
        ValueError: a degree does not divide the dimension it splits (the message names both keys).
    """
    tp, ep, pp = mesh.tensor_parallel, mesh.expert_parallel, mesh.pipeline_parallel
    if tp > 1:
        for key, value in (
            ("num_attention_heads", config.num_attention_heads),
            ("num_key_value_heads", config.kv_heads),
        ):
            if value % tp:
                raise ValueError(
                    f"model.{key}={value} is not divisible by mesh.tensor_parallel={tp}: tensor parallelism "
                    f"splits the heads; choose a tensor_parallel that divides {value}"
                )
        if config.moe is not None:
            raise ValueError(
                f"mesh.tensor_parallel={tp} with MoE layers (model.moe) is not supported yet: the experts have "
                "no tensor-parallel plan; split a MoE model with mesh.expert_parallel and data parallelism, "
                "or set mesh.tensor_parallel: 1"
            )
        if config.tie_word_embeddings and config.head is None:
            raise ValueError(
                "mesh.tensor_parallel > 1 with model.tie_word_embeddings: true is not supported (the "
                "vocab-parallel embedding and the column-parallel head split the shared table differently); "
                "set model.tie_word_embeddings: false or mesh.tensor_parallel: 1"
            )
    if ep > 1:
        if config.moe is None:
            raise ValueError(
                f"mesh.expert_parallel={ep} but the model has no experts (model.moe is null); set "
                "mesh.expert_parallel: 1 or configure model.moe"
            )
        if config.moe.num_experts % ep:
            raise ValueError(
                f"model.moe.num_experts={config.moe.num_experts} is not divisible by mesh.expert_parallel={ep}; "
                f"choose an expert_parallel that divides {config.moe.num_experts}"
            )
    if pp > config.num_layers:
        raise ValueError(
            f"mesh.pipeline_parallel={pp} is more than model.num_layers={config.num_layers}: every stage needs "
            "at least one layer; lower pipeline_parallel"
        )


def tensor_parallel_plan(model: ReferenceForCausalLM) -> TensorParallelPlan:
    """Heads and MLP columns split over tp, sequence-parallel norms, vocab-parallel embedding and head.

    The LM head returns full (replicated) logits so any loss works on them.
    """
    if model.config.tie_word_embeddings and model.lm_head is not None:
        raise ValueError(
            "tensor parallelism with tie_word_embeddings is not supported: the vocab-parallel embedding "
            "and the column-parallel LM head split the shared table differently; set model.tie_word_embeddings: false"
        )
    # One entry per module this model (stage) holds: a pipeline stage lacks some (the first holds no
    # head, a middle one neither embedding nor head, the embedding's may hold no layer).
    plan: TensorParallelPlan = {}
    if model.model.embed_tokens is not None and model.model.embeds_inputs:
        plan |= embedding_plan("model.embed_tokens")
    for name in model.model.layers:
        prefix = f"model.layers.{name}"
        plan |= attention_plan(f"{prefix}.self_attn", qkv=("q_proj", "k_proj", "v_proj"), out="o_proj")
        plan |= norm_plan(f"{prefix}.input_layernorm", f"{prefix}.post_attention_layernorm")
        if model.config.qk_norm:  # per-head norms: each tp rank normalizes its own heads (dim 2)
            plan |= {
                f"{prefix}.self_attn.q_norm": ReplicateParallel(input_layouts=Shard(2)),
                f"{prefix}.self_attn.k_norm": ReplicateParallel(input_layouts=Shard(2)),
            }
        if not model.config.is_moe_layer(int(name)):
            plan |= mlp_plan(f"{prefix}.mlp", up=("gate_proj", "up_proj"), down="down_proj")
    if model.model.norm is not None:
        plan |= norm_plan("model.norm")
    if model.lm_head is not None:
        plan |= lm_head_plan("lm_head", loss_parallel=False)
    if isinstance(model, ReferenceWithHead) and model.score is not None:  # replicated, after the gather
        plan["score"] = ReplicateParallel()
    return plan


def apply_tensor_parallel(model: ReferenceForCausalLM, context: DistributedContext) -> None:
    """Apply `tensor_parallel_plan` over the mesh's tp axis (a no-op when tp is 1)."""
    if context.axis_size("tp") > 1:
        parallelize_tensor_parallel(model, context.mesh("dense"), tensor_parallel_plan(model))
        model.model.sequence_parallel = context.axis_size("tp")  # the norms' plan shards the sequence


def apply_expert_parallel(
    model: ReferenceForCausalLM, context: DistributedContext, precision: MixedPrecision | None = None
) -> None:
    """Shard the experts of every MoE layer over ep_shard (a no-op for a dense model or ep 1)."""
    if model.config.moe is None or context.config.expert_parallel == 1:
        return
    if any(isinstance(module, MoE) for module in model.modules()):  # a pipeline stage may hold none
        parallelize_expert_parallel(model, context, precision=precision)


def decoder_parts(model: ReferenceForCausalLM) -> dict[str, nn.Module | None]:
    """The embedding, final norm and LM head the model (or pipeline stage) holds, None for those it
    lacks: the keyword arguments of `d9d.parallel.parallelize_decoder` and `decoder_units` besides
    the blocks (`model.model.layers`)."""
    head = model.score if isinstance(model, ReferenceWithHead) else model.lm_head
    return {"embedding": model.model.embed_tokens, "final_norm": model.model.norm, "head": head}


def shard_units(model: ReferenceForCausalLM) -> list[ShardUnit]:
    """The FSDP units of the model (or pipeline stage) by d9d's decoder rule
    (`d9d.parallel.decoder_units`), for `parallelize_hsdp(blocks=...)`."""
    return decoder_units(list(model.model.layers.values()), **decoder_parts(model))


def trim_to_stage(model: ReferenceForCausalLM, stage: StageSpec) -> None:
    """Keep only a pipeline stage's part of the model: its layers (whole-model names), the embedding on
    the first stage, the final norm and LM head (or `score` head) on the last. Call it on the meta device.

    With tied embeddings the last stage keeps `model.embed_tokens` too, unused in its forward, as the
    owner of the table its head shares (as in one process): its checkpoint and optimizer keys are then
    the whole model's, and `d9d.parallel.pipeline.Pipeline` keeps the stages' copies one parameter
    (`model.tied_parameters()`).
    """
    keep_stage_layers(model.model.layers, stage)
    if not stage.is_first:
        model.model.embeds_inputs = False
        if not (stage.is_last and model.config.tie_word_embeddings):
            model.model.embed_tokens = None
    if not stage.is_last:
        model.model.norm = None
        model.lm_head = None
        if isinstance(model, ReferenceWithHead):
            model.score = None
