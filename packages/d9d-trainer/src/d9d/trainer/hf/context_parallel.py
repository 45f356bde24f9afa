"""Context parallelism of the Hugging Face backend: d9d's context-parallel attention registered as a
transformers attention implementation.

Each rank holds two chunks of every sequence (`d9d.parallel.ContextParallel`'s load-balanced
layout). The model runs its own forward on them: `HFCausalLM` gives it the chunks' global
`position_ids` (so RoPE rotates by the real positions), the attention implementation
`d9d_context_parallel` replaces sdpa/eager in every attention module and computes exact causal
attention of the rank's queries against the whole sequence's keys and values
(`context_parallel_attention`: one all-gather of K and V), and its mask function builds no mask
(causality comes from the global positions of the chunks, not from a mask over the local ones).

What it cannot compute exactly is refused before anything is built (`context_parallel_problem`):
sliding-window or soft-capped attention, attention dropout, and classes that do not route attention
through transformers' attention interface. Packed documents with context parallelism are refused by
the trainer's plan for every model.
"""

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AttentionInterface, PretrainedConfig
from transformers.masking_utils import AttentionMaskInterface

from d9d.parallel import ContextParallel, context_parallel_attention, parallelize_context_parallel
from d9d.trainer.hf.errors import HFModelError

__all__ = ["ATTENTION", "apply_context_parallel", "context_parallel_problem"]

#: The attention implementation's name in transformers' registries.
ATTENTION = "d9d_context_parallel"


def context_parallel_problem(model_class: type, config: PretrainedConfig) -> str | None:
    """Why context parallelism cannot run `model_class` built from `config` exactly, or None."""
    text = config.get_text_config()
    if not getattr(model_class, "_supports_attention_backend", False):
        return (
            f"{model_class.__name__} does not route its attention through transformers' attention "
            "interface, so d9d's context-parallel attention cannot replace it"
        )
    window = getattr(text, "sliding_window", None)
    uses_window = getattr(text, "use_sliding_window", True)
    layer_types = getattr(text, "layer_types", None) or []
    if (window is not None and uses_window) or "sliding_attention" in layer_types:
        return f"its attention has a sliding window (sliding_window={window}), which it does not implement"
    if getattr(text, "attn_logit_softcapping", None):
        return "its attention soft-caps the logits (attn_logit_softcapping), which it does not implement"
    if float(getattr(text, "attention_dropout", 0.0) or 0.0) > 0:
        return "its attention has dropout (attention_dropout > 0), which it does not implement; set it to 0"
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
    if dropout or kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise HFModelError(
            f"{type(module).__name__} asks the context-parallel attention for dropout, a sliding window or "
            "soft-capping, which it does not implement; set mesh.context_parallel: 1"
        )
    out = context_parallel_attention(query, key, value, cp, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function of the implementation: none (causality is the attention's, by global position)."""
    return None


def _register() -> None:
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)
