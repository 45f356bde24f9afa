"""How many bytes of activations a forward keeps for backward, counted exactly from autograd's saved tensors.

`saved_activation_bytes` counts what one forward saves; it works on real devices and on the meta
device (a model built with `torch.device("meta")` and meta inputs: no memory is allocated), so the
same count serves a test and a launch plan. `SavedActivations` follows a whole training step (any
interleaving of forwards and backwards, e.g. a pipeline schedule) and keeps the peak of what is held
saved at once: the figure `d9d plan` estimates.
"""

import weakref
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn

from d9d.parallel.weight_casts import open_scope_copies

__all__ = ["SavedActivations", "saved_activation_bytes", "saved_activation_bytes_among"]


def saved_activation_bytes(fn: Callable[[], Any], *, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Run `fn()` (a forward, e.g. `lambda: loss_fn(model(x))`) and return the bytes it saves for backward.

    Each storage counts once (views of one activation count once); tensors in `exclude` (pass the
    model's parameters: they are not activations) and their views do not count.
    """
    return saved_activation_bytes_among(fn, among=(), exclude=exclude)[0]


def saved_activation_bytes_among(
    fn: Callable[[], Any], *, among: Sequence[torch.Tensor], exclude: Iterable[torch.Tensor] = ()
) -> tuple[int, int]:
    """`saved_activation_bytes`, and the part of it held by the storages of `among` (a list `fn` may
    fill as it runs, e.g. `recording_gathered_keys_values`'s K/V; read when each tensor is saved)."""
    excluded = {_storage_key(t) for t in exclude}
    seen: dict[int, int] = {}
    apart: set[int] = set()
    keep: list[torch.Tensor] = []  # hold them so ids are not reused while counting

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in excluded and key not in seen:
            seen[key] = _nbytes(tensor)
            keep.append(tensor.detach())  # its grad_fn would make a cycle gc cannot free
            if any(_storage_key(t) == key for t in among):
                apart.add(key)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(seen.values()), sum(seen[key] for key in apart)


def _storage_key(tensor: torch.Tensor) -> int:
    """The identity of the tensor's storage (the StorageImpl: shared by views, also on the meta device)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage()._cdata


def _nbytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().nbytes()


class SavedActivations:
    """While open, the bytes autograd holds saved for backward: `live` now, `peak` the most at once.

    Each storage counts once (views of one activation count once), from the first pack that saves it
    until the graph lets go of the last; the count needs no reference of its own to the tensors (it
    keeps none alive). Weights are not activations and do not count: the tensors in `exclude` (pass
    the model's parameters), any `nn.Parameter` and its views (FSDP2's gathered weights), and the
    compute copies of an open `weights_cast_once` scope (one per weight for the whole step).

    Example:
        with SavedActivations(exclude=model.parameters()) as saved:
            loss_fn(model(x)).backward()
        saved.peak  # the most bytes held for backward at once
    """

    def __init__(self, *, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_storage_key(t) for t in exclude}
        self._held: dict[int, list[int]] = {}  # storage -> [holders, bytes]
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._hooks.__exit__(kind, error, trace)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if _is_weight(tensor):
            return tensor
        key = _storage_key(tensor)
        if key in self._excluded or key in _cast_copies():
            return tensor
        entry = self._held.setdefault(key, [0, _nbytes(tensor)])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return _Held(tensor, self, key)

    def _release(self, key: int) -> None:
        entry = self._held[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._held[key]


class _Held:
    """One saved tensor, counted in its `SavedActivations` until autograd drops it."""

    def __init__(self, tensor: torch.Tensor, counter: SavedActivations, key: int) -> None:
        self.tensor = tensor
        weakref.finalize(self, counter._release, key)


def _unpack(saved: Any) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Held) else saved


def _is_weight(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def _cast_copies() -> set[int]:
    """The storages of the compute copies the open `weights_cast_once` scope holds."""
    return {_storage_key(copy) for copy in open_scope_copies()}
