"""Leaf transforms between several tensors and one: stack/unstack (experts), concat/chunk (fused qkv)."""

from collections.abc import Mapping, Sequence

import torch

from d9d.ckpt.mapper._base import MappingGroup, StateMapper
from d9d.ckpt.mapper._errors import MappingError

__all__ = ["Chunk", "Concat", "Stack", "Unstack"]


class _ManyToOne(StateMapper):
    def __init__(self, inputs: Sequence[str], output: str, *, dim: int = 0) -> None:
        self.input_keys = tuple(inputs)
        self.output = output
        self.dim = dim
        if not self.input_keys:
            raise MappingError(f"{type(self).__name__}({output!r}) needs at least one input key")
        self._set_groups([MappingGroup(frozenset(self.input_keys), frozenset([output]))])


class _OneToMany(StateMapper):
    def __init__(self, key: str, outputs: Sequence[str], *, dim: int = 0) -> None:
        self.key = key
        self.output_keys = tuple(outputs)
        self.dim = dim
        if not self.output_keys:
            raise MappingError(f"{type(self).__name__}({key!r}) needs at least one output key")
        self._set_groups([MappingGroup(frozenset([key]), frozenset(self.output_keys))])


class Stack(_ManyToOne):
    """Stacks same-shaped tensors along a new dim `dim` (per-expert weights → one grouped tensor)."""

    def _apply(self, group: MappingGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        parts = [tensors[k] for k in self.input_keys]
        shapes = {tuple(p.shape) for p in parts}
        if len(shapes) > 1:
            raise MappingError(
                f"{self!r}: inputs have different shapes {sorted(shapes)}; stacking needs one shape"
            )
        return {self.output: torch.stack(parts, dim=self.dim)}

    def inverse(self) -> "Unstack":
        """Unstack into the same keys."""
        return Unstack(self.output, self.input_keys, dim=self.dim)

    def __repr__(self) -> str:
        return f"Stack(<{len(self.input_keys)} keys> -> {self.output!r}, dim={self.dim})"


class Unstack(_OneToMany):
    """Splits dim `dim` of one tensor into one tensor per index (grouped experts → per-expert weights)."""

    def _apply(self, group: MappingGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensor = tensors[self.key]
        if tensor.dim() == 0 or tensor.shape[self.dim] != len(self.output_keys):
            raise MappingError(
                f"{self!r}: key {self.key!r} has shape {tuple(tensor.shape)}, so dim {self.dim} does not hold "
                f"the {len(self.output_keys)} entries named by the outputs"
            )
        return dict(zip(self.output_keys, tensor.unbind(self.dim), strict=True))

    def inverse(self) -> Stack:
        """Stack back into one tensor."""
        return Stack(self.output_keys, self.key, dim=self.dim)

    def __repr__(self) -> str:
        return f"Unstack({self.key!r} -> <{len(self.output_keys)} keys>, dim={self.dim})"


class Concat(_ManyToOne):
    """Concatenates tensors along `dim` (separate q, k, v → fused qkv; gate, up → gate_up).

    `sizes` (each input's extent along `dim`) is checked on apply; without it the inputs must have
    equal extents, so that `Chunk` undoes it.
    """

    def __init__(
        self, inputs: Sequence[str], output: str, *, dim: int = 0, sizes: Sequence[int] | None = None
    ) -> None:
        self.sizes = None if sizes is None else tuple(sizes)
        super().__init__(inputs, output, dim=dim)
        if self.sizes is not None and len(self.sizes) != len(self.input_keys):
            raise MappingError(f"{self!r}: {len(self.sizes)} sizes for {len(self.input_keys)} inputs")

    def _apply(self, group: MappingGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        parts = [tensors[k] for k in self.input_keys]
        got = tuple(p.shape[self.dim] if p.dim() else 0 for p in parts)
        expected = self.sizes if self.sizes is not None else (got[0],) * len(got)
        if got != expected:
            hint = "" if self.sizes is not None else "; pass sizes= for unequal parts"
            raise MappingError(f"{self!r}: extents along dim {self.dim} are {got}, expected {expected}{hint}")
        return {self.output: torch.cat(parts, dim=self.dim)}

    def inverse(self) -> "Chunk":
        """Split back into the same keys and sizes."""
        return Chunk(self.output, self.input_keys, dim=self.dim, sizes=self.sizes)

    def __repr__(self) -> str:
        return f"Concat(<{len(self.input_keys)} keys> -> {self.output!r}, dim={self.dim})"


class Chunk(_OneToMany):
    """Splits one tensor along `dim` into consecutive parts (fused qkv → q, k, v).

    `sizes` gives each part's extent; without it the parts are equal.
    """

    def __init__(
        self, key: str, outputs: Sequence[str], *, dim: int = 0, sizes: Sequence[int] | None = None
    ) -> None:
        self.sizes = None if sizes is None else tuple(sizes)
        super().__init__(key, outputs, dim=dim)
        if self.sizes is not None and len(self.sizes) != len(self.output_keys):
            raise MappingError(f"{self!r}: {len(self.sizes)} sizes for {len(self.output_keys)} outputs")

    def _apply(self, group: MappingGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensor = tensors[self.key]
        extent = tensor.shape[self.dim] if tensor.dim() else 0
        count = len(self.output_keys)
        if self.sizes is None and extent % count:
            raise MappingError(
                f"{self!r}: key {self.key!r} has {extent} entries along dim {self.dim}, not divisible into "
                f"{count} equal parts; pass sizes="
            )
        sizes = self.sizes if self.sizes is not None else (extent // count,) * count
        if sum(sizes) != extent:
            raise MappingError(
                f"{self!r}: sizes {sizes} sum to {sum(sizes)}, but key {self.key!r} has {extent}"
            )
        return dict(zip(self.output_keys, tensor.split(list(sizes), dim=self.dim), strict=True))

    def inverse(self) -> Concat:
        """Concatenate back."""
        return Concat(self.output_keys, self.key, dim=self.dim, sizes=self.sizes)

    def __repr__(self) -> str:
        return f"Chunk({self.key!r} -> <{len(self.output_keys)} keys>, dim={self.dim})"
