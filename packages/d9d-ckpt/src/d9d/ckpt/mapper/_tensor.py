"""Leaf transforms that change one tensor: transpose, reshape, RoPE row permutation, dtype cast."""

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from d9d.ckpt.mapper._base import MappingGroup, StateMapper
from d9d.ckpt.mapper._errors import MappingError, NotInvertibleError

__all__ = ["Cast", "Reshape", "RopePermute", "Transpose"]


class _OneTensor(StateMapper):
    """A transform of the tensor at `key`, written to `output` (default: the same key)."""

    def __init__(self, key: str, output: str | None) -> None:
        self.key = key
        self.output = key if output is None else output
        self._set_groups([MappingGroup(frozenset([key]), frozenset([self.output]))])

    def _apply(self, group: MappingGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.output: self._transform(tensors[self.key])}

    def _transform(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _fail(self, what: str) -> MappingError:
        return MappingError(f"{self!r} on key {self.key!r}: {what}")


class Transpose(_OneTensor):
    """Swaps two dims (e.g. `nn.Linear` weights stored as [in, out] by another framework)."""

    def __init__(self, key: str, *, dims: tuple[int, int] = (0, 1), output: str | None = None) -> None:
        self.dims = dims
        super().__init__(key, output)

    def _transform(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() < 2:
            raise self._fail(f"needs at least 2 dims, got shape {tuple(tensor.shape)}")
        return tensor.transpose(*self.dims)

    def inverse(self) -> "Transpose":
        """The same swap, back."""
        return Transpose(self.output, dims=self.dims, output=self.key)

    def __repr__(self) -> str:
        return f"Transpose({self.key!r}, dims={self.dims})"


class Reshape(_OneTensor):
    """Gives the tensor a new shape with the same number of elements.

    `source_shape`, when given, is checked on apply and makes the transform invertible.
    """

    def __init__(
        self,
        key: str,
        shape: Sequence[int],
        *,
        source_shape: Sequence[int] | None = None,
        output: str | None = None,
    ) -> None:
        self.shape = tuple(shape)
        self.source_shape = None if source_shape is None else tuple(source_shape)
        super().__init__(key, output)

    def _transform(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.source_shape is not None and tuple(tensor.shape) != self.source_shape:
            raise self._fail(f"expected shape {self.source_shape}, got {tuple(tensor.shape)}")
        try:
            return tensor.reshape(self.shape)
        except RuntimeError as exc:
            raise self._fail(f"cannot reshape {tuple(tensor.shape)} to {self.shape}") from exc

    def inverse(self) -> "Reshape":
        """Reshape back to `source_shape`."""
        if self.source_shape is None:
            raise NotInvertibleError(f"{self!r} is invertible only when built with source_shape=")
        return Reshape(self.output, self.source_shape, source_shape=self.shape, output=self.key)

    def __repr__(self) -> str:
        return f"Reshape({self.key!r}, {self.shape})"


RopeLayout = Literal["interleaved", "half"]


class RopePermute(_OneTensor):
    """Reorders the rows of a q/k projection between the two RoPE layouts.

    Dim 0 holds heads of `head_dim` rows each. "interleaved" pairs rows (0,1), (2,3), ... of a head
    (Meta's original layout); "half" pairs row i with row i + head_dim/2 (Hugging Face's layout).
    Works for weights and biases.
    """

    def __init__(
        self, key: str, head_dim: int, *, to: RopeLayout = "half", output: str | None = None
    ) -> None:
        if head_dim <= 0 or head_dim % 2:
            raise MappingError(
                f"RopePermute({key!r}): head_dim must be a positive even number, got {head_dim}"
            )
        if to not in ("half", "interleaved"):
            raise MappingError(f"RopePermute({key!r}): to= must be 'half' or 'interleaved', got {to!r}")
        self.head_dim = head_dim
        self.to: RopeLayout = to
        super().__init__(key, output)

    def _transform(self, tensor: torch.Tensor) -> torch.Tensor:
        rows = tensor.shape[0] if tensor.dim() else 0
        if rows % self.head_dim:
            raise self._fail(f"dim 0 ({rows} rows) is not a multiple of head_dim={self.head_dim}")
        heads, half, rest = rows // self.head_dim, self.head_dim // 2, tuple(tensor.shape[1:])
        split = (heads, half, 2) if self.to == "half" else (heads, 2, half)
        return tensor.reshape(*split, *rest).transpose(1, 2).reshape(tensor.shape)

    def inverse(self) -> "RopePermute":
        """The permutation to the other layout."""
        back: RopeLayout = "interleaved" if self.to == "half" else "half"
        return RopePermute(self.output, self.head_dim, to=back, output=self.key)

    def __repr__(self) -> str:
        return f"RopePermute({self.key!r}, head_dim={self.head_dim}, to={self.to!r})"


class Cast(_OneTensor):
    """Converts the tensor to `dtype`; invertible when `source_dtype` is given (exact only when widening)."""

    def __init__(
        self,
        key: str,
        dtype: torch.dtype,
        *,
        source_dtype: torch.dtype | None = None,
        output: str | None = None,
    ) -> None:
        self.dtype = dtype
        self.source_dtype = source_dtype
        super().__init__(key, output)

    def _transform(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.source_dtype is not None and tensor.dtype != self.source_dtype:
            raise self._fail(f"expected dtype {self.source_dtype}, got {tensor.dtype}")
        return tensor.to(self.dtype)

    def inverse(self) -> "Cast":
        """Cast back to `source_dtype`."""
        if self.source_dtype is None:
            raise NotInvertibleError(f"{self!r} is invertible only when built with source_dtype=")
        return Cast(self.output, self.source_dtype, source_dtype=self.dtype, output=self.key)

    def __repr__(self) -> str:
        return f"Cast({self.key!r}, {self.dtype})"
