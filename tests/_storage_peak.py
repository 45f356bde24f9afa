"""`StoragePeak`: the most bytes of tensor storage alive at once among those created while it is
active, counted exactly, op by op (not sampled RSS): what a build or an import holds at its peak.

Every aten op runs through it; each output's storage (a DTensor's local one) that torch allocated is
remembered by a weak reference with its size, and the live total is summed after every op, when
storages freed since the last op have expired. Not counted: the meta device, and storages over memory
torch did not allocate (not resizable), such as safetensors' views of the memory-mapped file, which
cost the file's pages a rank reads (page cache), not an allocation, and the storages of `exclude`
(what existed before: a model's parameters, which its state dict's views would otherwise count).
"""

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StoragePeak(TorchDispatchMode):
    """Peak bytes (`peak`) of the live storages created under the mode."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._exclude = {_local(t).untyped_storage()._cdata for t in exclude}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(_local(tensor))
        self._live = {key: (ref, size) for key, (ref, size) in self._live.items() if not ref.expired()}
        self.peak = max(self.peak, sum(size for _, size in self._live.values()))
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        if storage.resizable() and storage._cdata not in self._live and storage._cdata not in self._exclude:
            self._live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor
