"""How many bytes of activations a forward keeps for backward, counted exactly from autograd's saved tensors.

Works on real devices and on the meta device (a model built with `torch.device("meta")` and meta
inputs: no memory is allocated), so the same count serves a test and a launch plan.
"""

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["saved_activation_bytes"]


def saved_activation_bytes(fn: Callable[[], Any], *, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Run `fn()` (a forward, e.g. `lambda: loss_fn(model(x))`) and return the bytes it saves for backward.

    Each storage counts once (views of one activation count once); tensors in `exclude` (pass the
    model's parameters: they are not activations) and their views do not count.
    """
    excluded = {_storage_key(t) for t in exclude}
    seen: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # hold them so ids are not reused while counting

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in excluded and key not in seen:
            seen[key] = _nbytes(tensor)
            keep.append(tensor.detach())  # its grad_fn would make a cycle gc cannot free
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(seen.values())


def _storage_key(tensor: torch.Tensor) -> int:
    """The identity of the tensor's storage (the StorageImpl: shared by views, also on the meta device)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage()._cdata


def _nbytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().nbytes()
