"""Context parallelism of the Hugging Face backend: d9d's context-parallel attention registered as a
transformers attention implementation.

Each rank holds two chunks of every sequence (`d9d.parallel.ContextParallel`'s load-balanced
layout). The model runs its own forward on them: `HFCausalLM` gives it the chunks' global
`position_ids` (so RoPE rotates by the real positions; packed rows keep each document's own positions,
sharded with the batch), the attention implementation `d9d_context_parallel` replaces sdpa/eager in
every attention module and computes exact attention of the rank's queries against the whole
sequence's keys and values (`context_parallel_attention`: one all-gather of K and V), and its mask
function builds no mask (causality comes from the global positions of the chunks, not from a mask
over the local ones).

Packed documents and sliding windows (Mistral, Qwen2 with a window, Gemma 2/3's local layers): the
model's forward builds one `d9d.parallel.DocumentMask` per batch over the cp group (`batch_mask`,
also for Gemma 2's soft-capped logits, which the mask's attention computes:
the keys' document ids gathered once, a mask per window the layers use) and passes it down to every
attention call as the keyword `d9d_attention_mask`; each layer asks it for its own window
(transformers passes `sliding_window` per layer), so a query sees the earlier keys of its own
document within its window, on whichever rank they are.

It is offered for the architectures whose every layer is causal attention (windowed or not) through
transformers' attention interface and that are tested against one process
(`CONTEXT_PARALLEL_ARCHITECTURES`); anything else (linear-attention, convolution or chunked layers,
attention sinks, bidirectional attention, attention dropout) is refused before
anything is built (`context_parallel_problem`), and the attention refuses any argument it would drop.
"""

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AttentionInterface, PretrainedConfig
from transformers.masking_utils import AttentionMaskInterface

from d9d.parallel import (
    ContextParallel,
    DocumentMask,
    context_parallel_attention,
    parallelize_context_parallel,
)
from d9d.trainer.hf.errors import HFModelError

__all__ = [
    "ATTENTION",
    "CONTEXT_PARALLEL_ARCHITECTURES",
    "MASK_KEYWORD",
    "apply_context_parallel",
    "batch_mask",
    "context_parallel_problem",
    "layer_windows",
]

#: The attention implementation's name in transformers' registries.
ATTENTION = "d9d_context_parallel"
#: The keyword the model's forward passes the batch's `DocumentMask` down to the attention under.
MASK_KEYWORD = "d9d_attention_mask"
#: model_type of the architectures context parallelism is offered for: every layer causal attention
#: (windowed or not), each tested at cp 2 against one process (packages/d9d-trainer/tests/hf/test_hf_context_parallel.py).
CONTEXT_PARALLEL_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text"})
#: Arguments transformers passes an attention implementation that change nothing here.
_HARMLESS = frozenset({"sliding_window", "softcap", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                       "max_length_q", "max_length_k", "is_causal", "output_attentions", "head_mask",
                       "cache_position", "use_cache"})  # fmt: skip


def context_parallel_problem(model_class: type, config: PretrainedConfig) -> str | None:
    """Why context parallelism cannot run `model_class` built from `config` exactly, or None.

    What the config's attention computes that d9d's context-parallel attention does not (dropout) is
    named first: it is the reason that holds whatever is verified later. Sliding windows and
    soft-capped logits are computed (`batch_mask`).
    """
    text = config.get_text_config()
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", "?")
    features = []
    if float(getattr(text, "attention_dropout", 0.0) or 0.0) > 0:
        features.append("has dropout (attention_dropout > 0; set it to 0)")
    if features:
        return f"its attention {' and '.join(features)}, which d9d's context-parallel attention does not implement"
    if model_type not in CONTEXT_PARALLEL_ARCHITECTURES:
        return (
            f"model_type {model_type!r} is not verified with it (offered for "
            f"{', '.join(sorted(CONTEXT_PARALLEL_ARCHITECTURES))}: every layer causal attention)"
        )
    if not getattr(model_class, "_supports_attention_backend", False):
        return (
            f"{model_class.__name__} does not route its attention through transformers' attention "
            "interface, so d9d's context-parallel attention cannot replace it"
        )
    return None


def apply_context_parallel(model: nn.Module, hf_model: Any, mesh: DeviceMesh | None) -> ContextParallel:
    """Give `model`'s attention modules (and `model` itself, for the positions) the mesh's cp group
    and switch the transformers model to the `d9d_context_parallel` attention; a no-op without cp.

    Raises:
        HFModelError: no attention module was found.
    """
    _register()
    attention = [m for m in model.modules() if _is_attention(m)]
    if not attention:
        raise HFModelError(
            f"{type(hf_model).__name__} has no attention module (one with layer_idx, is_causal and scaling) "
            "to give the cp group; set mesh.context_parallel: 1"
        )
    for module in attention:
        module.context_parallel = None  # declares support (parallelize_context_parallel sets it)
    cp = parallelize_context_parallel(model, mesh)
    if cp.enabled:
        hf_model.config._attn_implementation = ATTENTION
        text = hf_model.config.get_text_config()
        if text is not hf_model.config:
            text._attn_implementation = ATTENTION
    return cp


def layer_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """The sliding windows the model's layers attend within (None: a layer without one), as
    transformers decides them: `sliding_window` when `use_sliding_window` (default on) allows it, per
    layer where `layer_types` names "sliding_attention" and "full_attention" layers."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    if window is None or not getattr(text, "use_sliding_window", True):
        return (None,)
    layer_types = getattr(text, "layer_types", None)
    if not layer_types:
        return (int(window),)
    return tuple(sorted({int(window) if kind == "sliding_attention" else None for kind in layer_types},
                        key=lambda w: -1 if w is None else w))  # fmt: skip


def batch_mask(
    config: PretrainedConfig, cp: ContextParallel, input_ids: torch.Tensor, document_ids: torch.Tensor | None
) -> DocumentMask | None:
    """The attention mask of this batch under context parallelism, built once for every layer: over
    the packed documents (`document_ids`, this rank's share) and the layers' windows; None when the
    rows are single documents, no layer has a window and the logits are not soft-capped (plain
    causal attention needs none)."""
    windows = layer_windows(config)
    softcap = getattr(config.get_text_config(), "attn_logit_softcapping", None)
    if document_ids is None and windows == (None,) and not softcap:
        return None
    if document_ids is None:
        document_ids = torch.zeros_like(input_ids)
    return DocumentMask(document_ids, context_parallel=cp, windows=windows)


def _is_attention(module: nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("layer_idx", "is_causal", "scaling"))


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: [b, heads, s, d] in, [b, s, heads, d] out."""
    cp = getattr(module, "context_parallel", None)
    if not isinstance(cp, ContextParallel):
        raise HFModelError(f"{type(module).__name__} runs the {ATTENTION} attention without a cp group")
    mask = kwargs.pop(MASK_KEYWORD, None)
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    unknown = sorted(k for k, v in kwargs.items() if k not in _HARMLESS and v is not None)
    asks = [name for name, on in (("dropout", bool(dropout)),
                                  ("a sliding window without the batch's mask", window is not None and mask is None),
                                  ("soft-capping without the batch's mask", softcap is not None and mask is None),
                                  ("bidirectional attention", getattr(module, "is_causal", True) is False),
                                  (f"arguments it would drop ({', '.join(unknown)})", bool(unknown))) if on]  # fmt: skip
    if asks:
        raise HFModelError(
            f"{type(module).__name__} asks the context-parallel attention for {', '.join(asks)}, which it does "
            "not implement; set mesh.context_parallel: 1"
        )
    if mask is not None:
        out = mask.attention(query, key, value, scale=scaling, window=window, softcap=softcap)
    else:
        out = context_parallel_attention(query, key, value, cp, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function of the implementation: none (causality is the attention's, by global position)."""
    return None


def _register() -> None:
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)
