"""State mappers between the reference model and Hugging Face checkpoints, and the folder IO on top.

Dense models map by identity (the names mirror Hugging Face's); MoE experts stack and unstack, in
either layout transformers 5 writes (`hf_expert_layout`): the Hub's per-expert one (`save_pretrained`'s
default) or its fused `mlp.experts.gate_up_proj`/`down_proj`. With `tie_word_embeddings`, HF stores the
table once as `model.embed_tokens.weight`; a folder that also stores `lm_head.weight` loads too (the copy
is ignored, as transformers ignores it). The mappers are plain `d9d.ckpt` transforms: nothing here
imports transformers.
"""

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch
from torch import nn

from d9d.ckpt import (
    Concat,
    Deduplicate,
    Drop,
    Duplicate,
    Identity,
    Parallel,
    Prefix,
    Rename,
    Sequential,
    StateMapper,
    Transpose,
    Unstack,
    load_safetensors,
    save_safetensors,
)
from d9d.trainer.models.config import ClassificationHead, MoEBalancingConfig, ReferenceModelConfig
from d9d.trainer.models.heads import build_reference_model, check_head_export
from d9d.trainer.models.hf_config import HFConversionError, hf_model_type, read_hf_config, to_hf_config

__all__ = [
    "ExpertLayout",
    "head_fresh_keys",
    "hf_checkpoint_keys",
    "hf_expert_layout",
    "hf_export_mapper",
    "hf_import_mapper",
    "load_hf_pretrained",
    "save_hf_pretrained",
]

#: How an HF checkpoint stores MoE experts (see `hf_expert_layout`).
ExpertLayout = Literal["per_expert", "fused"]


_EMBED = "model.embed_tokens.weight"


_LM_HEAD = "lm_head.weight"


_SCORE = "score.weight"


# Reference-config fields that do not change what the weights compute.
_NUMERICALLY_INERT = ("initializer_range", "max_position_embeddings", "fp32_logits", "hf_model_type", "head")


def _model_keys(config: ReferenceModelConfig) -> list[str]:
    """The state-dict keys of the full model, from a storage-free meta build."""
    with torch.device("meta"):
        return list(build_reference_model(config).state_dict())


#: HF per-expert projection names of (our w_gate, w_up, w_down): Qwen3-MoE's, and Mixtral's w1/w3/w2.
_EXPERT_NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


def _experts_to_hf(
    num_experts: int, model_type: str, layout: ExpertLayout, *, score_bias: bool = False
) -> StateMapper:
    """One MoE block (keys relative to `mlp.`): router rename, stacked [E, a, b] → HF's experts.

    "per_expert": E weights [b, a] per projection (`experts.<j>.<name>.weight`, the Hub's layout);
    "fused": transformers 5's in-memory tensors, `experts.gate_up_proj` [E, 2·ffn, hidden] (gate rows
    first) and `experts.down_proj` [E, hidden, ffn].
    """
    parts: list[StateMapper] = [Rename("router.gate.weight", "gate.weight")]
    if score_bias:  # auxiliary-loss-free balancing state: no HF counterpart (a fresh run starts it at 0)
        parts.append(Drop(["router.score_bias"]))
    # ours stores x @ W ([in, out]); HF stores nn.Linear weights ([out, in]).
    if layout == "fused":
        gate, up = "experts.w_gate", "experts.w_up"
        halves = Parallel([Transpose(gate, dims=(1, 2)), Transpose(up, dims=(1, 2))])
        parts.append(Sequential([halves, Concat([gate, up], "experts.gate_up_proj", dim=1)]))
        parts.append(Transpose("experts.w_down", dims=(1, 2), output="experts.down_proj"))
        return Parallel(parts)
    for ours, theirs in zip(("w_gate", "w_up", "w_down"), _EXPERT_NAMES[model_type], strict=True):
        key = f"experts.{ours}"
        per_expert = [f"experts.{j}.{theirs}.weight" for j in range(num_experts)]
        parts.append(Sequential([Transpose(key, dims=(1, 2)), Unstack(key, per_expert)]))
    return Parallel(parts)


def hf_expert_layout(keys: Iterable[str]) -> ExpertLayout:
    """The experts' layout of an HF checkpoint from its keys (`hf_checkpoint_keys(folder)`): "fused" when
    it holds transformers 5's `mlp.experts.gate_up_proj` tensors (`save_pretrained(save_original_format=False)`),
    else "per_expert" (the Hub's layout, and what `save_pretrained` writes by default)."""
    return "fused" if any(k.endswith(".mlp.experts.gate_up_proj") for k in keys) else "per_expert"


def hf_export_mapper(
    config: ReferenceModelConfig, *, expert_layout: ExpertLayout = "per_expert"
) -> StateMapper:
    """Mapper from the reference model's state-dict keys to the HF layout of `hf_model_type(config)`.

    Use with `save_safetensors(model, folder, mapper=hf_export_mapper(config))` (or `save_hf_pretrained`).

    Args:
        expert_layout: how MoE experts are stored (`hf_expert_layout`): pass the layout of the folder a
            model was imported from to export it back as it was read.
    """
    model_type = hf_model_type(config)
    keys = _model_keys(config)
    parts: list[StateMapper] = []
    handled: set[str] = set()
    if config.tie_word_embeddings and config.head is None:  # a head model has no LM head to tie
        parts.append(Deduplicate([_EMBED, _LM_HEAD], _EMBED))  # HF saves a tied table once
        handled |= {_EMBED, _LM_HEAD}
    if config.moe is not None:
        for index in range(config.num_layers):
            if config.is_moe_layer(index):
                prefix = f"model.layers.{index}.mlp."
                # Mixtral's Hub layout calls the block block_sparse_moe; transformers 5's fused one mlp
                block = (
                    "block_sparse_moe."
                    if model_type == "mixtral" and expert_layout == "per_expert"
                    else "mlp."
                )
                experts = _experts_to_hf(
                    config.moe.num_experts, model_type, expert_layout, score_bias=_has_score_bias(config)
                )
                parts.append(Prefix(prefix, experts, output_prefix=f"model.layers.{index}.{block}"))
                handled |= {k for k in keys if k.startswith(prefix)}
    parts.extend(Identity(k) for k in keys if k not in handled)
    return Parallel(parts)


def _has_score_bias(config: ReferenceModelConfig) -> bool:
    return config.moe is not None and config.moe.balancing.bias_update_rate > 0


def hf_import_mapper(
    config: ReferenceModelConfig, *, source_keys: Iterable[str] | None = None
) -> StateMapper:
    """Mapper from an HF checkpoint's keys to the reference model's: the inverse of `hf_export_mapper`.

    Args:
        source_keys: the keys the folder holds (`hf_checkpoint_keys(folder)`). Needed for a tied model
            whose folder also stores `lm_head.weight` (that copy is then read and dropped, as transformers
            ignores it) and for MoE experts in transformers 5's fused layout (`hf_expert_layout`). None
            assumes `save_pretrained`'s own layout (the tied table stored once, experts one by one).
    """
    layout = hf_expert_layout(source_keys or ())
    if config.head is not None:
        return _head_import_mapper(config, source_keys)
    if _has_score_bias(config):  # the folder has no score bias to give: the model's keeps its zero init
        assert config.moe is not None
        unbiased = msgspec.structs.replace(config.moe, balancing=MoEBalancingConfig())
        config = msgspec.structs.replace(config, moe=unbiased)
    mapper = hf_export_mapper(config, expert_layout=layout).inverse()
    if config.tie_word_embeddings and source_keys is not None and _LM_HEAD in set(source_keys):
        assert isinstance(mapper, Parallel)
        others = [m for m in mapper.mappers if _LM_HEAD not in m.outputs]
        mapper = Parallel([*others, Duplicate(_EMBED, [_EMBED, _LM_HEAD]), Drop([_LM_HEAD])])
    return mapper


def _head_import_mapper(config: ReferenceModelConfig, source_keys: Iterable[str] | None) -> StateMapper:
    """A head model's import: the decoder as a causal LM's, its LM head (if the folder holds one) dropped,
    and `score.weight` read where the folder has it (one `AutoModelForSequenceClassification` saved);
    else the head keeps its init (`head_fresh_keys`)."""
    keys = set(source_keys) if source_keys is not None else set()
    causal = msgspec.structs.replace(config, head=None, tie_word_embeddings=False)
    mapper = hf_import_mapper(causal, source_keys=keys)
    assert isinstance(mapper, Parallel)
    parts = [m for m in mapper.mappers if _LM_HEAD not in m.outputs]
    if _LM_HEAD in keys:
        parts.append(Drop([_LM_HEAD]))
    if _SCORE in keys and not head_fresh_keys(config, keys):
        parts.append(Identity(_SCORE))
    return Parallel(parts)


def head_fresh_keys(config: ReferenceModelConfig, source_keys: Iterable[str]) -> frozenset[str]:
    """The model keys a folder of `source_keys` does not fill and that keep their init: a classification
    head's `score.weight` when the folder is a causal LM's (or holds no score)."""
    if not isinstance(config.head, ClassificationHead):
        return frozenset()
    return frozenset() if _SCORE in set(source_keys) else frozenset({_SCORE})


def hf_checkpoint_keys(folder: str | os.PathLike[str]) -> list[str]:
    """The tensor keys of a safetensors folder, from its index (or the single file's header): no data read."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return sorted(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    single = folder / "model.safetensors"
    if not single.exists():
        raise HFConversionError(f"{folder} holds neither model.safetensors.index.json nor model.safetensors")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as handle:
        return sorted(handle.keys())


def save_hf_pretrained(
    model: nn.Module,
    folder: str | os.PathLike[str],
    *,
    config: ReferenceModelConfig | None = None,
    max_shard_size: int | str = "5GB",
    expert_layout: ExpertLayout = "per_expert",
) -> None:
    """Write the model as an HF folder: safetensors through `hf_export_mapper` plus `config.json`.

    Call it on every rank of a distributed job (the weights are gathered one group at a time);
    only global rank 0 writes. `config` defaults to `model.config`.
    """
    config = config if config is not None else model.config
    assert isinstance(config, ReferenceModelConfig)
    check_head_export(model, config)
    dtype = next(iter(model.state_dict().values())).dtype
    hf = to_hf_config(config, dtype=dtype)
    mapper = hf_export_mapper(config, expert_layout=expert_layout)
    save_safetensors(model, folder, mapper=mapper, max_shard_size=max_shard_size)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        (Path(folder) / "config.json").write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")


def _computation(config: ReferenceModelConfig) -> dict[str, Any]:
    """The fields that decide what the weights compute, with the None defaults resolved."""
    fields = {k: getattr(config, k) for k in config.__struct_fields__ if k not in _NUMERICALLY_INERT}
    fields |= {"num_key_value_heads": config.kv_heads, "head_dim": config.attention_head_dim}
    return fields


def load_hf_pretrained(model: nn.Module, folder: str | os.PathLike[str]) -> None:
    """Fill the model in place from an HF folder through `hf_import_mapper`, after checking its config.json.

    Raises:
        HFConversionError: the folder's config computes something else than `model.config`.
    """
    config = model.config
    assert isinstance(config, ReferenceModelConfig)
    ours, theirs = _computation(config), _computation(read_hf_config(folder))
    if differ := [f"{k}: model {v!r}, folder {theirs[k]!r}" for k, v in ours.items() if theirs[k] != v]:
        raise HFConversionError(f"{folder}/config.json does not describe this model ({'; '.join(differ)})")
    keys = hf_checkpoint_keys(folder)
    fresh = head_fresh_keys(
        config, keys
    )  # a causal LM's folder under a classification head: score keeps its init
    target = {k: v for k, v in model.state_dict().items() if k not in fresh} if fresh else model
    load_safetensors(target, folder, mapper=hf_import_mapper(config, source_keys=keys))
