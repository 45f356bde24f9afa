"""The reference decoder: a Llama/Qwen3-style causal LM in plain PyTorch.

Module names mirror Hugging Face `Qwen3ForCausalLM` (`model.embed_tokens`, `model.layers.<i>.self_attn.q_proj`,
`...mlp.gate_proj`, `model.norm`, `lm_head`), so the state-dict mapping to that layout is the identity
for dense models. Built for d9d's lifecycle: construct on the meta device, parallelize, `to_empty`,
then `init_weights()`. Layers live in an `nn.ModuleDict` keyed by their index so a pipeline stage can
delete the layers it does not own (and set `embed_tokens`, `norm` or `lm_head` to None) while keeping
every remaining parameter's name.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from d9d.trainer.models.attention_inputs import KVCache, attention_mask
from d9d.trainer.models.config import MoEConfig, ReferenceModelConfig, check_sequence_length
from d9d.trainer.models.rope import RotaryEmbedding, apply_rotary

__all__ = [
    "MLP",
    "Attention",
    "DecoderLayer",
    "RMSNorm",
    "ReferenceForCausalLM",
    "ReferenceModel",
    "build_moe",
]


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32, scaled by a learned weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize `x` [..., dim]; the result has the dtype of `x`."""
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        # In x's dtype: under autocast the float32 weight would make the product float32 (FSDP's
        # gathered weight is already the compute dtype, so both paths compute the same).
        return _weight_in(self.weight, normed.dtype) * normed

    def reset_parameters(self) -> None:
        """Weight to ones."""
        nn.init.ones_(self.weight)


def _weight_in(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` in `dtype`: once per optimizer step inside the trainer's step (`d9d.parallel.cast_weight`),
    at every call without d9d.parallel."""
    try:
        from d9d.parallel import cast_weight
    except ImportError:  # the model itself is plain PyTorch
        return weight.to(dtype)
    return cast_weight(weight, dtype)


def _in_compute_dtype(hidden_states: torch.Tensor) -> torch.Tensor:
    """The embedding's output in autocast's compute dtype (`d9d.parallel.to_autocast_dtype`), so the
    residual stream is bf16 on every mesh; unchanged without d9d.parallel. Cast after the embedding
    module returns: on a vocab-split embedding (tensor parallel) its output is then this rank's plain
    tensor, reduced in the table's float32 (casting the partial DTensor inside would all-reduce it)."""
    try:
        from d9d.parallel import to_autocast_dtype
    except ImportError:  # the model itself is plain PyTorch
        return hidden_states
    return to_autocast_dtype(hidden_states)


class Attention(nn.Module):
    """Causal self-attention with RoPE, grouped-query heads, optional per-head q/k RMSNorm (Qwen3) and
    optional q/k/v biases (Qwen2).

    Head counts are inferred from the projection outputs at run time, so the module keeps working
    when tensor parallelism leaves each rank a slice of the heads.
    """

    def __init__(self, config: ReferenceModelConfig) -> None:
        super().__init__()
        self.head_dim = config.attention_head_dim
        q_width = config.num_attention_heads * self.head_dim
        kv_width = config.kv_heads * self.head_dim
        bias = config.qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, q_width, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_width, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_width, bias=bias)
        self.o_proj = nn.Linear(q_width, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # Set by d9d.parallel.parallelize_context_parallel: the sequence is split over cp ranks and
        # attention gathers the keys and values of the whole sequence.
        self.context_parallel: Any = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: Any = None,
        kv_cache: tuple[KVCache, str] | None = None,
    ) -> torch.Tensor:
        """`hidden_states` [batch, seq, hidden] → [batch, seq, hidden]; `position_embeddings` is (cos, sin).

        `attention_mask` replaces the plain causal mask: a `d9d.parallel.DocumentMask` of packed
        documents (FlexAttention on CUDA, masked SDPA elsewhere), or a bool [batch, 1, seq, seq]
        tensor (True = may attend). `kv_cache` (the cache and this layer's name): the tokens attend to
        the cached ones before them too, and their keys and values are stored.
        """
        batch, seq, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, seq, -1, self.head_dim)
        k = self.k_proj(hidden_states).view(batch, seq, -1, self.head_dim)
        v = self.v_proj(hidden_states).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv_cache is not None:
            cache, layer = kv_cache
            held = cache.length
            k, v = cache.extend(layer, k, v)
            gqa = q.shape[1] != k.shape[1]
            if held == 0:  # the prompt: plain causal attention
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:  # new token i sees every held token and the new ones up to itself
                new = torch.arange(seq, device=q.device)[:, None] + held
                allowed = torch.arange(held + seq, device=q.device)[None, :] <= new
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)
        elif attention_mask is not None:  # under context parallelism a DocumentMask over the cp group
            if isinstance(attention_mask, torch.Tensor):
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attention_mask, enable_gqa=q.shape[1] != k.shape[1]
                )
            else:  # a DocumentMask: its own kernel
                out = attention_mask.attention(q, k, v)
        elif self.context_parallel is not None:
            out = self.context_parallel.attention(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: `down_proj(silu(gate_proj(x)) * up_proj(x))`, no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to `x` [..., hidden]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def build_moe(hidden_size: int, moe: MoEConfig) -> nn.Module:
    """The MoE feed-forward of one layer: `d9d.parallel`'s `MoE`, so expert parallelism applies to it.

    Raises:
        NotImplementedError: `d9d.parallel` (with its expert-parallel MoE) is not installed.
    """
    try:
        from d9d.parallel.expert import MoE, MoEBalancing
    except ImportError as error:
        raise NotImplementedError(
            "model.moe needs the MoE layer of d9d.parallel (d9d.parallel.expert.MoE), which is not "
            "importable here; install d9d-parallel or remove model.moe for a dense model"
        ) from error
    return MoE(
        hidden_size,
        moe.moe_intermediate_size,
        moe.num_experts,
        moe.top_k,
        renormalize=moe.norm_topk_prob,
        shared_ffn_size=moe.shared_expert_intermediate_size,
        balancing=MoEBalancing(
            aux_loss_coef=moe.balancing.aux_loss_coef,
            z_loss_coef=moe.balancing.z_loss_coef,
            bias_update_rate=moe.balancing.bias_update_rate,
        ),
    )


class DecoderLayer(nn.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`; the MLP is dense or MoE."""

    def __init__(self, config: ReferenceModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if config.moe is not None and config.is_moe_layer(index):
            self.mlp = build_moe(config.hidden_size, config.moe)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: Any = None,
        kv_cache: tuple[KVCache, str] | None = None,
    ) -> torch.Tensor:
        """`hidden_states` [batch, seq, hidden] → same shape (`attention_mask`, `kv_cache`: see `Attention`)."""
        extra = {} if kv_cache is None else {"kv_cache": kv_cache}
        attn_out = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **extra,
        )
        hidden_states = hidden_states + attn_out
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class ReferenceModel(nn.Module):
    """The decoder stack without the LM head (HF's `Qwen3Model`): tokens → final hidden states.

    For pipeline stages, `embeds_inputs` may be False (the input is then hidden states [batch, seq,
    hidden]; `embed_tokens` is None, or only holds the table a tied LM head shares) and `norm` may be
    None (the output is the un-normalized hidden states).
    """

    def __init__(self, config: ReferenceModelConfig) -> None:
        super().__init__()
        self.config = config
        # An explicit empty table skips nn.Embedding's own normal_ init: `init_weights` fills it, and on
        # the meta device torch's normal_ imports torch._dynamo (seconds of start-up for nothing).
        table = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens: nn.Embedding | None = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=table
        )
        self.embeds_inputs = True  # False on every pipeline stage but the first
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i) for i in range(config.num_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.attention_head_dim, config.rope_theta, config.rope_scaling)
        self.context_parallel: Any = None  # as in Attention: this rank's tokens' global positions
        # Which attention code runs (set by d9d.parallel.apply_attention_kernel from trainer.attention):
        # "auto"/"sdpa": SDPA (packed documents: DocumentMask's own choice / a dense mask), "flex": FlexAttention.
        self.attention_backend = "auto"
        # Tensor parallelism's sequence-parallel norms split the hidden states between layers over tp
        # ranks: a pipeline stage that starts from hidden states sees 1/tp of the sequence.
        self.sequence_parallel: int = 1

    def forward(
        self,
        inputs: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """`inputs`: token ids [batch, seq] (hidden states when not `embeds_inputs`) → [batch, seq, hidden].

        Args:
            position_ids: [batch, seq] or [seq] positions for RoPE; default 0..seq-1. Pass them on a
                pipeline stage whose incoming hidden states are sequence-sharded, and with packed
                documents (positions restarting at 0 per document).
            document_ids: [batch, seq] document of each token (packed rows, e.g. d9d.data's
                `document_masking`): attention is block-causal, never across documents.
            kv_cache: the tokens before these (`new_kv_cache`, generation on one process): positions
                continue after them, attention sees them, and the cache then holds these tokens too.
        """
        if kv_cache is not None:
            return self._forward_cached(inputs, kv_cache)
        embedding = self.embed_tokens if self.embeds_inputs else None
        # The residual stream in the compute dtype on every mesh (autocast leaves a lookup in float32)
        hidden_states = _in_compute_dtype(embedding(inputs)) if embedding is not None else inputs
        # The sequence length comes from `inputs`: under sequence parallelism the embedding's output
        # holds only this rank's slice of the sequence, while attention sees all of it.
        batch, seq = inputs.shape[:2]
        if embedding is None:  # hidden states from the previous stage, sequence-sharded under tp
            seq *= self.sequence_parallel
        cp = self.context_parallel.size if self.context_parallel is not None else 1
        check_sequence_length(self.config, seq * cp)  # a window shorter than the sequence: refused
        if position_ids is None and self.context_parallel is not None:  # this rank's part of the sequence
            position_ids = self.context_parallel.position_ids(seq * cp, inputs.device)
        elif position_ids is None:
            position_ids = torch.arange(seq, device=inputs.device)
        position_ids = position_ids.expand(batch, -1)
        position_embeddings = self.rotary_emb(position_ids, hidden_states.dtype)
        # once, for every layer; under cp it gathers the documents of the whole row once
        mask = attention_mask(document_ids, self.attention_backend, inputs, seq, self.context_parallel)
        for layer in self.layers.values():
            if mask is None:  # the plain call keeps the layers' (compiled, checkpointed) signature
                hidden_states = layer(hidden_states, position_embeddings=position_embeddings)
            else:
                hidden_states = layer(
                    hidden_states, position_embeddings=position_embeddings, attention_mask=mask
                )
        return self.norm(hidden_states) if self.norm is not None else hidden_states

    def _forward_cached(self, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """`forward` after the tokens `cache` holds (the whole model, one process, no packing)."""
        if self.embed_tokens is None or self.norm is None or self.context_parallel is not None:
            raise ValueError(
                "a KV cache needs the whole model on one process (no pipeline or context parallelism)"
            )
        seq = input_ids.shape[1]
        check_sequence_length(self.config, cache.length + seq)
        hidden_states = _in_compute_dtype(self.embed_tokens(input_ids))
        positions = torch.arange(cache.length, cache.length + seq, device=input_ids.device)
        position_embeddings = self.rotary_emb(positions.expand(input_ids.shape[0], -1), hidden_states.dtype)
        for name, layer in self.layers.items():
            hidden_states = layer(
                hidden_states, position_embeddings=position_embeddings, kv_cache=(cache, name)
            )
        cache.advance(seq)
        return self.norm(hidden_states)


class ReferenceForCausalLM(nn.Module):
    """Causal LM (HF's `Qwen3ForCausalLM`): `model` (the decoder stack) and `lm_head`.

    Build on any device, including meta; when the parameters are real the constructor initializes
    them with `init_weights()`. After `to_empty(device=...)` call `init_weights()` again: it also
    recomputes the RoPE buffers and re-ties the LM head to the embedding (`to_empty` unties them).
    """

    def __init__(self, config: ReferenceModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = ReferenceModel(config)
        self.lm_head: nn.Linear | None = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        if not next(self.parameters()).is_meta:
            # Nothing to fill on meta (and torch's meta normal_ imports torch._dynamo).
            self.init_weights()

    def tie_weights(self) -> None:
        """Make the LM head share the embedding table when `tie_word_embeddings` (a no-op otherwise)."""
        if (
            self.config.tie_word_embeddings
            and self.lm_head is not None
            and self.model.embed_tokens is not None
        ):
            self.lm_head.weight = self.model.embed_tokens.weight

    def tied_parameters(self) -> list[tuple[str, ...]]:
        """Names of parameters that are one tensor in the whole model (`[]` when untied).

        d9d's pipeline reads it: a stage holding only the head keeps the table too (`trim_to_stage`),
        and the stages' copies are kept one parameter (gradients summed, the norm counted once).
        """
        if not self.config.tie_word_embeddings:
            return []
        return [("model.embed_tokens.weight", "lm_head.weight")]

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialize in place from the global RNG: normal(0, initializer_range) for every weight, ones for
        norms, zeros for biases.

        Also recomputes the RoPE buffers and re-ties the embeddings. Parameters are visited in
        registration order, so a seed gives the same weights whether the model was built on CPU or on
        meta and then `to_empty(device="cpu")`.
        """
        self.tie_weights()
        done = set()  # parameters with a fixed init: they draw nothing from the RNG
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
                done.add(id(module.weight))
            elif isinstance(module, RotaryEmbedding):
                module.reset_buffers()
            elif isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
                done.add(id(module.bias))
        for param in self.parameters():  # each shared parameter once
            if id(param) not in done:
                nn.init.normal_(param, mean=0.0, std=self.config.initializer_range)

    @torch.no_grad()
    def initialize_module(self, path: str, module: nn.Module) -> None:
        """Initialize one module's own parameters and buffers, as `init_weights` would.

        d9d's trainer calls it for every module that owns tensors, on an unsharded copy seeded per
        module path, so the initial weights are the same on every mesh.
        """
        del path
        if isinstance(module, RMSNorm):
            module.reset_parameters()
        elif isinstance(module, RotaryEmbedding):
            module.reset_buffers()
        else:
            for name, param in module.named_parameters(recurse=False):
                if isinstance(module, nn.Linear) and name == "bias":
                    nn.init.zeros_(param)
                else:
                    nn.init.normal_(param, mean=0.0, std=self.config.initializer_range)
            for buffer in module.buffers(recurse=False):  # e.g. a MoE router's score bias: starts at 0
                nn.init.zeros_(buffer)

    def new_kv_cache(self, max_length: int) -> KVCache:
        """An empty KV cache for up to `max_length` tokens per row (d9d's `generate` uses it: the
        prompt once, then one forward per new token)."""
        return KVCache(max_length)

    @property
    def fused_loss_chunk_size(self) -> int | None:
        """Tokens per chunk when the head computes the loss fused (its `lm_head` made a
        `d9d.parallel.LinearCrossEntropyHead` by the provider, `trainer.loss.fused`); else None."""
        try:
            from d9d.parallel import LinearCrossEntropyHead
        except ImportError:  # the model itself is plain PyTorch
            return None
        return self.lm_head.chunk_size if isinstance(self.lm_head, LinearCrossEntropyHead) else None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`input_ids` [batch, seq] → logits [batch, seq, vocab] (float32 when `config.fp32_logits`).

        With `labels` [batch, seq] (already shifted; -100 adds nothing) and a fused head
        (`fused_loss_chunk_size`): the summed token cross-entropy instead (float32, 0-dim), no
        full-vocabulary logits made. On a pipeline stage without `lm_head` the output is the hidden
        states (`labels` unused). `position_ids`, `document_ids` and `kv_cache` as in `ReferenceModel.forward`.

        Raises:
            ValueError: `labels` given to a model whose head is not fused.
        """
        if kv_cache is not None:
            hidden_states = self.model(input_ids, kv_cache=kv_cache)
        else:
            hidden_states = self.model(input_ids, position_ids, document_ids)
        if self.lm_head is None:
            return hidden_states
        if labels is not None:
            if self.fused_loss_chunk_size is None:
                raise ValueError("labels were given but the LM head computes no loss: fuse it with "
                                 "d9d.parallel.fuse_linear_cross_entropy (trainer.loss.fused)")  # fmt: skip
            return self.lm_head(hidden_states, labels=labels)
        logits = self.lm_head(hidden_states)
        return logits.float() if self.config.fp32_logits else logits
