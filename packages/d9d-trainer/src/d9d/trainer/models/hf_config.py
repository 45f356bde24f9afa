"""`config.json` conversion between the reference model and the Hugging Face architectures that compute it.

These Hugging Face architectures have the reference model's computation exactly:

| reference config | HF `model_type` | what the mapper does |
|---|---|---|
| dense, `qk_norm=True` | `qwen3` (`Qwen3ForCausalLM`) | identity |
| dense, `qk_norm=False` | `llama` (`LlamaForCausalLM`) | identity (HF Llama checkpoints already use the half-split RoPE rows) |
| dense, `qk_norm=False`, `sliding_window` set (or `hf_model_type="mistral"`) | `mistral` (`MistralForCausalLM`) | identity |
| dense, `qk_norm=False`, `qkv_bias=True` | `qwen2` (`Qwen2ForCausalLM`) | identity (q/k/v biases as `*_proj.bias`) |
| `moe`, `qk_norm=True`, no shared expert | `qwen3_moe` (`Qwen3MoeForCausalLM`) | router rename, stacked experts ↔ one `[ffn, hidden]` weight per expert |
| `moe` in every layer, `qk_norm=False`, renormalized top-k, no shared expert | `mixtral` (`MixtralForCausalLM`) | `block_sparse_moe.gate` ↔ router, stacked experts ↔ `experts.<j>.w1`/`w3`/`w2` (gate, up, down) |

Any of them with RoPE scaling (`rope_scaling`: linear, llama3, yarn). MoE experts load from either
layout transformers 5 writes (`hf_expert_layout`): the Hub's per-expert one (`save_pretrained`'s
default) or its fused `mlp.experts.gate_up_proj`/`down_proj`; `hf_export_mapper(expert_layout=)` writes
either. A sliding window is kept in the config and sequences longer than it are refused
(`check_sequence_length`), since the reference model attends to the whole sequence.

With `tie_word_embeddings`, HF stores the table once as `model.embed_tokens.weight` (no `lm_head.weight`);
the import mapper also accepts a folder that stores both and, as transformers does, ignores the copy.
Nothing here imports transformers: the mappers are plain `d9d.ckpt` transforms and the configs plain dicts.
"""

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import torch

from d9d.mesh import D9dError
from d9d.trainer.models.config import (
    LinearRopeScaling,
    Llama3RopeScaling,
    MoEConfig,
    ReferenceModelConfig,
    RopeScaling,
    SlidingWindowError,
    YarnRopeScaling,
    check_sequence_length,
)
from d9d.trainer.models.heads import head_hf_fields

__all__ = ["HFConversionError", "from_hf_config", "hf_model_type", "read_hf_config", "to_hf_config"]

_ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


# The architectures whose window transformers gates with use_sliding_window (and for the dense Qwens,
# max_window_layers: layers from that index on use it).
_QWEN_WINDOWS = ("qwen2", "qwen3", "qwen3_moe")


# transformers 5.x class defaults for keys a config.json may omit (they differ per architecture:
# Qwen3's head_dim is 128 whatever the width, Qwen3-MoE does not renormalise top-k weights).
_COMMON_DEFAULTS: dict[str, Any] = {"rope_theta": 10_000.0, "rms_norm_eps": 1e-6, "sliding_window": 4096}


_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768},
    "llama": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048},
    "qwen2": {"num_key_value_heads": 32, "head_dim": None, "max_position_embeddings": 32768},
    "mistral": {"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 131072},
    "mixtral": {
        "num_key_value_heads": 8,
        "head_dim": None,
        "max_position_embeddings": 131072,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "qwen3_moe": {
        "num_key_value_heads": 4,
        "head_dim": None,
        "max_position_embeddings": 32768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}


class HFConversionError(D9dError, ValueError):
    """A config or checkpoint has no exact counterpart in the other layout; the message says which key.

    A `D9dError`: a job reports it as one `error:` line (a user's file, not a bug)."""


def hf_model_type(config: ReferenceModelConfig) -> str:
    """The HF `model_type` with this config's computation: "qwen3", "llama", "mistral", "qwen2" or
    "qwen3_moe"; `config.hf_model_type` where it names another with the same computation.

    Raises:
        HFConversionError: for MoE without q/k norm or with a shared expert, q/k/v biases with q/k norm
            or experts (no exact HF architecture), or an `hf_model_type` that computes something else.
    """
    computed = _computed_model_type(config)
    chosen = config.hf_model_type
    if chosen is None or chosen == computed:
        return computed
    if chosen == "mistral" and computed == "llama":  # a Mistral without a window is a Llama
        return chosen
    raise HFConversionError(
        f"model.hf_model_type={chosen!r} does not compute this model (the config computes a {computed}"
        + (", with model.sliding_window" if computed == "mistral" else "")
        + "); remove model.hf_model_type or change the config"
    )


def _computed_model_type(config: ReferenceModelConfig) -> str:
    if config.qkv_bias:
        if config.qk_norm or config.moe is not None:
            raise HFConversionError(
                "model.qkv_bias: true has a Hugging Face counterpart only in Qwen2, which has neither q/k norm "
                "nor experts (Qwen3's attention_bias biases o_proj too); set model.qk_norm: false and "
                "model.moe: null to export as qwen2"
            )
        return "qwen2"
    if config.moe is None:
        if config.qk_norm:
            return "qwen3"
        return "llama" if config.sliding_window is None else "mistral"  # Llama has no window
    if config.moe.shared_expert_intermediate_size is not None:
        raise HFConversionError(
            "model.moe.shared_expert_intermediate_size is set, but Qwen3-MoE and Mixtral have no shared expert "
            "(and Qwen2-MoE's shared expert has a sigmoid gate the reference model lacks); remove it to export"
        )
    if config.qk_norm:
        return "qwen3_moe"
    moe = config.moe  # without q/k norm: Mixtral, if the experts are laid out as Mixtral's
    mismatch = None
    if not all(config.is_moe_layer(i) for i in range(config.num_layers)):
        mismatch = "experts in every layer: set model.moe.every_n_layers: 1 and no model.moe.layers"
    elif not moe.norm_topk_prob:
        mismatch = "top-k weights renormalized to sum 1: set model.moe.norm_topk_prob: true"
    elif config.intermediate_size != moe.moe_intermediate_size:
        mismatch = (
            f"one width for its experts (and no dense layer): model.intermediate_size={config.intermediate_size} "
            f"differs from model.moe.moe_intermediate_size={moe.moe_intermediate_size}; set both to one value"
        )
    if mismatch is not None:
        raise HFConversionError(
            f"model.moe with model.qk_norm: false exports as Mixtral, which has {mismatch} (or set "
            "model.qk_norm: true to export as qwen3_moe)"
        )
    return "mixtral"


def _moe_layout_to_hf(config: ReferenceModelConfig, moe: MoEConfig) -> dict[str, Any]:
    if moe.layers is None:
        return {"decoder_sparse_step": moe.every_n_layers, "mlp_only_layers": []}
    return {
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(config.num_layers) if i not in moe.layers],
    }


def to_hf_config(config: ReferenceModelConfig, *, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The HF `config.json` contents for this config (`AutoConfig`/`AutoModelForCausalLM` read it).

    Args:
        dtype: the dtype the weights are saved in, recorded as `"dtype"` (omitted when None).

    Raises:
        HFConversionError: when no HF architecture computes the same thing (see `hf_model_type`).
    """
    model_type = hf_model_type(config)
    hf: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.attention_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        **_rope_to_hf(config),
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if model_type in ("llama", "qwen3", "qwen3_moe"):  # the others have no key: no biases, or Qwen2's q/k/v
        hf["attention_bias"] = False
    if model_type == "llama":
        hf["mlp_bias"] = False
    elif model_type in _QWEN_WINDOWS:  # a window, if any, in every layer (see _window_from_hf)
        hf["use_sliding_window"] = config.sliding_window is not None
        hf["sliding_window"] = config.sliding_window
        if config.sliding_window is not None and model_type != "qwen3_moe":
            hf["max_window_layers"] = 0
    else:
        hf["sliding_window"] = config.sliding_window
    if model_type == "mixtral":
        assert config.moe is not None
        hf |= {
            "num_local_experts": config.moe.num_experts,
            "num_experts_per_tok": config.moe.top_k,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
        }
    if model_type == "qwen3_moe":
        assert config.moe is not None
        hf |= {
            "num_experts": config.moe.num_experts,
            "num_experts_per_tok": config.moe.top_k,
            "moe_intermediate_size": config.moe.moe_intermediate_size,
            "norm_topk_prob": config.moe.norm_topk_prob,
            **_moe_layout_to_hf(config, config.moe),
        }
    if dtype is not None:
        hf["dtype"] = str(dtype).removeprefix("torch.")
    return hf | head_hf_fields(config.head, _ARCHITECTURES[model_type])


_ROPE_KEYS: dict[str, tuple[type[RopeScaling], tuple[str, ...]]] = {
    # rope_type: (our struct, the keys transformers requires besides rope_type)
    "linear": (LinearRopeScaling, ("factor",)),
    "llama3": (Llama3RopeScaling, ("factor", "low_freq_factor", "high_freq_factor")),
    "yarn": (YarnRopeScaling, ("factor",)),
}

_YARN_OPTIONAL = ("attention_factor", "mscale", "mscale_all_dim", "truncate")


def _rope_from_hf(
    hf: Mapping[str, Any], default_theta: float, max_positions: int, source: str
) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling of a config.json, read as transformers reads them.

    transformers 5 keeps them in `rope_parameters` (with `rope_theta` inside); older configs have
    `rope_scaling` (which wins, as in transformers) and a top-level `rope_theta`. Keys a rope type does
    not use are ignored, as transformers ignores them.
    """
    where = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params: Mapping[str, Any] = hf.get(where) or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", default_theta)))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise HFConversionError(
            f"{source} has partial_rotary_factor={partial!r}; the reference model rotates whole heads "
            "(partial_rotary_factor 1); use another backend (model.backend: hf)"
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in _ROPE_KEYS:
        raise HFConversionError(
            f"{source} {where}.rope_type={rope_type!r} is not supported by the reference model (supported: "
            f"default, {', '.join(_ROPE_KEYS)}); use another backend (model.backend: hf)"
        )
    struct, required = _ROPE_KEYS[rope_type]
    if missing := [k for k in required if k not in params]:
        raise HFConversionError(f"{source} {where} of rope_type {rope_type!r} lacks {missing}")
    fields = {k: params[k] for k in required}
    if rope_type in ("llama3", "yarn"):  # transformers defaults the pretraining length to the model's
        fields["original_max_position_embeddings"] = int(
            params.get("original_max_position_embeddings") or max_positions
        )
    if rope_type == "yarn":
        if fields["factor"] is None:  # transformers: the ratio of the context lengths
            fields["factor"] = max_positions / fields["original_max_position_embeddings"]
        fields |= {k: params[k] for k in _YARN_OPTIONAL if params.get(k) is not None}
        fields |= {k: params[k] for k in ("beta_fast", "beta_slow") if params.get(k)}  # 0 or None: default
    try:
        return theta, msgspec.convert(fields, struct)
    except msgspec.ValidationError as error:
        raise HFConversionError(f"{source} {where}: {error}") from None


def _rope_to_hf(config: ReferenceModelConfig) -> dict[str, Any]:
    """`rope_theta` (transformers 4) and `rope_parameters` (5); with a scaling also `rope_scaling` (4)."""
    hf: dict[str, Any] = {
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
    }
    if config.rope_scaling is not None:
        builtins = msgspec.to_builtins(config.rope_scaling)  # rope_type first, then its fields
        scaling = {k: v for k, v in builtins.items() if v is not None}
        hf["rope_scaling"] = scaling
        hf["rope_parameters"] = {**scaling, "rope_theta": config.rope_theta}
    return hf


def _window_from_hf(hf: Mapping[str, Any], model_type: str, default: int | None) -> int | None:
    """The attention window some layer of the HF model uses, as transformers decides it; None if none does.

    Mistral (and Mixtral) window every layer when `sliding_window` is set; the Qwens only with
    `use_sliding_window`, and Qwen2/Qwen3 only from layer `max_window_layers` on (or where `layer_types`
    says "sliding_attention"). The reference model keeps the window to refuse longer sequences, so a
    Qwen windowed in only some layers exports as windowed in every layer: the same computation for
    every sequence the reference model accepts.
    """
    if model_type == "llama":
        return None
    window = hf.get("sliding_window", default)
    if window is None:
        return None
    if model_type in _QWEN_WINDOWS:
        if not hf.get("use_sliding_window", False):
            return None
        if model_type != "qwen3_moe":
            first = int(hf.get("max_window_layers", 28))  # transformers' default
            layer_types = hf.get("layer_types") or [
                "sliding_attention" if i >= first else "full_attention"
                for i in range(int(hf["num_hidden_layers"]))
            ]
            if "sliding_attention" not in layer_types:
                return None
    return int(window)


def _require(hf: Mapping[str, Any], key: str, expected: object, source: str) -> None:
    value = hf.get(key, expected)
    if value != expected:
        raise HFConversionError(
            f"{source} has {key}={value!r}; the reference model supports only {key}={expected!r}; use another "
            "backend (model.backend: hf)"
        )


def from_hf_config(
    hf: Mapping[str, Any], *, seq_len: int | None = None, source: str = "config.json", **overrides: Any
) -> ReferenceModelConfig:
    """A `ReferenceModelConfig` from an HF `config.json` dict of a model of one of `_ARCHITECTURES`.

    Keys the dict omits take transformers' class defaults for that architecture. `overrides` set
    reference-only fields (e.g. `fp32_logits=True`).

    Args:
        seq_len: the longest sequence the model will see: a sliding window shorter than it is refused
            (the reference model attends to the whole sequence). None: the window is kept in the config,
            and `check_sequence_length` (or the model's forward) refuses longer sequences later.
        source: what the error messages call the dict (`read_hf_config` passes the file's path).

    Raises:
        HFConversionError: another architecture, or a feature the reference model lacks (biases on o_proj
            or the MLP, a RoPE type other than default/linear/llama3/yarn, an activation other than SiLU),
            or a sliding window shorter than `seq_len`.
    """
    model_type = _check_supported(hf, source)
    defaults = _COMMON_DEFAULTS | _HF_DEFAULTS[model_type]
    fields = _dense_fields(hf, model_type, defaults, source)
    moe = _moe_from_hf(hf, model_type, defaults, fields)
    if moe is not None:
        fields["moe"] = moe
    fields.update(overrides)
    config = ReferenceModelConfig.from_dict(fields)
    if seq_len is not None:
        try:
            check_sequence_length(config, seq_len, key=f"{source} sliding_window")
        except SlidingWindowError as error:
            raise HFConversionError(str(error)) from None
    return config


def _check_supported(hf: Mapping[str, Any], source: str) -> str:
    """The config's `model_type`, once it is one the reference model computes with the keys it needs
    and none of the features it lacks."""
    model_type = hf.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise HFConversionError(
            f"{source} has model_type {model_type!r}, which the reference model does not implement (it does "
            f"{', '.join(sorted(_ARCHITECTURES))}); train it with transformers' own model: model.backend: hf "
            "(d9d.trainer:HFModelProvider) or d9d.trainer.hf:HFCausalLMProvider"
        )
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in hf]
    if model_type == "qwen3_moe":
        missing += [k for k in ("num_experts_per_tok", "moe_intermediate_size") if k not in hf]
        if "num_experts" not in hf and "num_local_experts" not in hf:
            missing.append("num_experts")
    if missing:
        raise HFConversionError(f"{source} of a {model_type} model lacks {missing}")
    _require(hf, "hidden_act", "silu", source)
    if model_type in ("llama", "qwen3", "qwen3_moe"):  # the keys of q, k, v and o biases
        _require(hf, "attention_bias", False, source)
        _require(hf, "mlp_bias", False, source)
    if model_type == "mixtral":  # training-time noise on the router's input the reference model lacks
        _require(hf, "router_jitter_noise", 0.0, source)
    return str(model_type)


def _dense_fields(
    hf: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any], source: str
) -> dict[str, Any]:
    """The reference config's fields of the model's attention, MLP, norms and RoPE."""
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    max_positions = int(hf.get("max_position_embeddings", defaults["max_position_embeddings"]))
    theta, rope_scaling = _rope_from_hf(hf, defaults["rope_theta"], max_positions, source)
    window = _window_from_hf(hf, model_type, defaults["sliding_window"])
    kv_heads = hf.get("num_key_value_heads", defaults["num_key_value_heads"])
    head_dim = hf.get("head_dim", defaults["head_dim"])
    return {
        "vocab_size": int(hf["vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(hf["intermediate_size"]),
        "num_layers": int(hf["num_hidden_layers"]),
        "num_attention_heads": heads,
        # None where the value is the reference default, so that configs round-trip unchanged
        "num_key_value_heads": None if kv_heads is None or int(kv_heads) == heads else int(kv_heads),
        "head_dim": None if head_dim is None or int(head_dim) * heads == hidden else int(head_dim),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "rms_norm_eps": float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qk_norm": model_type in ("qwen3", "qwen3_moe"),
        "qkv_bias": model_type == "qwen2",
        "sliding_window": window,
        # None where the computation names the type already (a Mistral with a window)
        "hf_model_type": "mistral" if model_type == "mistral" and window is None else None,
        "initializer_range": float(hf.get("initializer_range", 0.02)),
    }


def _moe_from_hf(
    hf: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any], fields: Mapping[str, Any]
) -> MoEConfig | None:
    """The experts of a Qwen3-MoE (in the layers its sparse step and dense list leave) or a Mixtral
    (every layer: softmax over all experts, top-k, renormalized); None for a dense model."""
    if model_type == "qwen3_moe":
        num_experts = int(hf.get("num_experts", hf.get("num_local_experts", 0)))
        if num_experts <= 0:
            return None
        step = int(hf.get("decoder_sparse_step", defaults["decoder_sparse_step"]))
        dense_only = list(hf.get("mlp_only_layers") or defaults["mlp_only_layers"])
        layout: dict[str, Any] = {"every_n_layers": step}
        if dense_only:
            layers = (i for i in range(fields["num_layers"]) if (i + 1) % step == 0)
            layout = {"layers": tuple(i for i in layers if i not in dense_only)}
        return MoEConfig(
            num_experts=num_experts,
            top_k=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", defaults["norm_topk_prob"])),
            **layout,
        )
    if model_type == "mixtral":
        return MoEConfig(
            num_experts=int(
                hf.get("num_local_experts", hf.get("num_experts", defaults["num_local_experts"]))
            ),
            top_k=int(hf.get("num_experts_per_tok", defaults["num_experts_per_tok"])),
            moe_intermediate_size=fields["intermediate_size"],
            norm_topk_prob=True,
        )
    return None


def read_hf_config(
    folder: str | os.PathLike[str], *, seq_len: int | None = None, **overrides: Any
) -> ReferenceModelConfig:
    """`from_hf_config` of `<folder>/config.json` (its errors name that file)."""
    path = Path(folder) / "config.json"
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFConversionError(f"{path}: no config.json; is {folder} a Hugging Face model folder?") from None
    return from_hf_config(hf, seq_len=seq_len, source=str(path), **overrides)
