"""How transformers saves a model whose tensors in memory differ from its checkpoints' (MoE experts).

transformers 5 holds the experts of an MoE layer fused (`mlp.experts.gate_up_proj` [E, 2·ffn,
hidden], `mlp.experts.down_proj` [E, hidden, ffn]) but `save_pretrained` writes, and the Hub holds,
one Linear weight per expert (`mlp.experts.<j>.gate_proj.weight`), sometimes under another module
name (Mixtral's `block_sparse_moe`). It declares that per architecture as a list of conversions
(`transformers.conversion_mapping`): renamings and converters (merge the per-expert list, then
concatenate gate and up). `saved_format` turns the model's list into a d9d mapper from the model's
keys to the folder's, so the backend reads either layout and exports the one it read.

Only the conversions whose inverse is plain stacking are taken: literal renamings, `MergeModulelist`
on dim 0, then optionally `Concatenate` on dim 1. Another conversion the folder needs is refused in
one line naming it.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass

from transformers import PreTrainedModel

from d9d.ckpt import Chunk, Identity, Parallel, Rename, Sequential, StateMapper, Unstack
from d9d.trainer.hf.errors import HFModelError

__all__ = ["SavedFormat", "saved_format"]

_LITERAL = re.compile(r"[\w.]+")


@dataclass(frozen=True)
class SavedFormat:
    """The folder layout transformers' conversions give a model's stored keys.

    Attributes:
        mapper: the model's stored keys → the folder's (the export direction; `inverse()` imports).
        keys: the folder keys it writes.
        converted: whether it differs from the model's own keys anywhere.
    """

    mapper: StateMapper
    keys: frozenset[str]
    converted: bool


def saved_format(model: PreTrainedModel, shapes: Mapping[str, tuple[int, ...]]) -> SavedFormat:
    """The checkpoint layout of `model` (any device, meta included) for its stored keys and `shapes`.

    Args:
        shapes: the model's stored keys (tied aliases left out) and their shapes.

    Raises:
        HFModelError: the model declares a conversion other than renaming and expert stacking.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming

    renamings: list[tuple[str, str]] = []
    converters: list[tuple[list[str], str, int]] = []  # (source patterns, target, how many merged parts)
    architecture = type(model).__name__
    for conversion in get_model_conversion_mapping(model, add_legacy=False):
        sources, targets = list(conversion.source_patterns), list(conversion.target_patterns)
        literal = all(_LITERAL.fullmatch(p.replace("*", "0")) for p in (*sources, *targets))
        if isinstance(conversion, WeightRenaming) and literal and len(sources) == len(targets) == 1:
            renamings.append((sources[0], targets[0]))
            continue
        if isinstance(conversion, WeightConverter) and literal and len(targets) == 1:
            kinds = [(type(op), getattr(op, "dim", None)) for op in conversion.operations]
            if kinds == [(MergeModulelist, 0)] and len(sources) == 1:
                converters.append((sources, targets[0], 1))
                continue
            if kinds == [(MergeModulelist, 0), (Concatenate, 1)] and len(sources) > 1:
                converters.append((sources, targets[0], len(sources)))
                continue
        if type(conversion).__name__ == "PrefixChange":  # transformers drops these on save too
            continue
        raise HFModelError(
            f"{architecture}'s checkpoints are converted by transformers ({type(conversion).__name__} "
            f"{sources} -> {targets}), which the Hugging Face backend does not map yet; save the folder "
            "with save_pretrained(save_original_format=False) so it holds the model's own tensors"
        )

    def saved_name(key: str) -> str:
        for source, target in renamings:
            key = key.replace(target, source)
        return key

    parts: list[StateMapper] = []
    keys: set[str] = set()
    converted = False
    for key, shape in shapes.items():
        match = next(
            (
                c
                for c in converters
                if key.endswith(c[1]) and (c[1].startswith(".") or key == c[1] or key.endswith("." + c[1]))
            ),
            None,
        )
        if match is None:
            name = saved_name(key)
            parts.append(Identity(key) if name == key else Rename(key, name))
            keys.add(name)
            converted |= name != key
            continue
        sources, target, count = match
        prefix = key[: len(key) - len(target)]
        groups = [[saved_name(prefix + s.replace("*", str(j))) for j in range(shape[0])] for s in sources]
        keys.update(k for group in groups for k in group)
        converted = True
        if count == 1:
            parts.append(Unstack(key, groups[0], dim=0))
            continue
        pieces = [f"{key}.__part{i}" for i in range(count)]
        parts.append(
            Sequential(
                [
                    Chunk(key, pieces, dim=1),
                    Parallel(
                        [Unstack(piece, group, dim=0) for piece, group in zip(pieces, groups, strict=True)]
                    ),
                ]
            )
        )
    return SavedFormat(mapper=Parallel(parts), keys=frozenset(keys), converted=converted)
