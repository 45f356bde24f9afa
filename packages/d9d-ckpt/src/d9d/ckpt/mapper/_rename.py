"""Leaf transforms that move tensors between keys without touching values: identity, rename, drop, tie."""

import re
from collections.abc import Iterable, Mapping

import torch

from d9d.ckpt.mapper._base import MappingGroup, StateMapper
from d9d.ckpt.mapper._compose import Parallel
from d9d.ckpt.mapper._errors import MappingError

__all__ = ["Deduplicate", "Drop", "Duplicate", "Identity", "Rename", "identity_map", "rename_pattern"]


class Rename(StateMapper):
    """Moves the tensor at `source` to `target`, unchanged."""

    def __init__(self, source: str, target: str) -> None:
        self.source = source
        self.target = target
        self._set_groups([MappingGroup(frozenset([source]), frozenset([target]))])

    def _apply(self, group: MappingGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.target: tensors[self.source]}

    def inverse(self) -> "Rename":
        """Rename back."""
        return Rename(self.target, self.source)

    def direct_sources(self) -> dict[str, str]:
        """The target is the source unchanged."""
        return {self.target: self.source}

    def __repr__(self) -> str:
        return f"Rename({self.source!r} -> {self.target!r})"


class Identity(Rename):
    """Keeps the tensor at `key` under the same key."""

    def __init__(self, key: str) -> None:
        super().__init__(key, key)

    def inverse(self) -> "Identity":
        """Itself."""
        return Identity(self.source)

    def __repr__(self) -> str:
        return f"Identity({self.source!r})"


class Drop(StateMapper):
    """Consumes `keys` and produces nothing (e.g. rotary caches or buffers the target does not have)."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = tuple(keys)
        if not self.keys:
            raise MappingError("Drop() needs at least one key")
        self._set_groups([MappingGroup(frozenset(self.keys), frozenset())])

    def _apply(self, group: MappingGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {}

    def __repr__(self) -> str:
        return f"Drop({list(self.keys)!r})"


class Duplicate(StateMapper):
    """One tensor under several keys: a tied weight stored once (e.g. HF `tie_word_embeddings`)."""

    def __init__(self, key: str, outputs: Iterable[str]) -> None:
        self.key = key
        self.output_keys = tuple(outputs)
        if not self.output_keys:
            raise MappingError(f"Duplicate({key!r}) needs at least one output key")
        self._set_groups([MappingGroup(frozenset([key]), frozenset(self.output_keys))])

    def _apply(self, group: MappingGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict.fromkeys(self.output_keys, tensors[self.key])

    def inverse(self) -> "Deduplicate":
        """Keep one copy, after checking the copies agree."""
        return Deduplicate(self.output_keys, self.key)

    def direct_sources(self) -> dict[str, str]:
        """Every output is the input unchanged."""
        return dict.fromkeys(self.output_keys, self.key)

    def __repr__(self) -> str:
        return f"Duplicate({self.key!r} -> {list(self.output_keys)!r})"


class Deduplicate(StateMapper):
    """Several keys holding the same tensor (tied weights) stored once under `output`.

    Raises:
        MappingError: on apply, when the tensors differ (the weights were not tied after all).
    """

    def __init__(self, keys: Iterable[str], output: str) -> None:
        self.input_keys = tuple(keys)
        self.output = output
        if not self.input_keys:
            raise MappingError(f"Deduplicate({output!r}) needs at least one input key")
        self._set_groups([MappingGroup(frozenset(self.input_keys), frozenset([output]))])

    def _apply(self, group: MappingGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        first = tensors[self.input_keys[0]]
        for key in self.input_keys[1:]:
            other = tensors[key]
            if first.device.type != "meta" and not (
                other.shape == first.shape and other.dtype == first.dtype and torch.equal(other, first)
            ):
                raise MappingError(
                    f"{self!r}: {key!r} differs from {self.input_keys[0]!r}, so they are not tied; "
                    "map them to separate keys instead"
                )
        return {self.output: first}

    def inverse(self) -> Duplicate:
        """Write the one tensor under every key again."""
        return Duplicate(self.output, self.input_keys)

    def __repr__(self) -> str:
        return f"Deduplicate({list(self.input_keys)!r} -> {self.output!r})"


def identity_map(keys: Iterable[str]) -> Parallel:
    """Every key kept as is: the mapper to use when the key spaces already agree."""
    return Parallel([Identity(k) for k in keys])


def rename_pattern(pattern: str, replacement: str, keys: Iterable[str]) -> Parallel:
    """One `Rename` per key of `keys` that fully matches the regex `pattern`.

    `replacement` uses `re` group references, so layer indices carry over:
    `rename_pattern(r"layers\\.(\\d+)\\.attn\\.wq\\.weight", r"model.layers.\\1.self_attn.q_proj.weight", keys)`.

    Raises:
        MappingError: when no key matches (a typo in the pattern would otherwise map nothing).
    """
    regex = re.compile(pattern)
    keys = list(keys)
    renames = [Rename(k, m.expand(replacement)) for k in keys if (m := regex.fullmatch(k))]
    if not renames:
        sample = ", ".join(repr(k) for k in sorted(keys)[:5])
        raise MappingError(
            f"rename_pattern({pattern!r}) matched none of {len(keys)} keys (e.g. {sample}); "
            "the pattern must match a whole key"
        )
    return Parallel(renames)
