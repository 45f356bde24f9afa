"""Which tensors autograd keeps for backward right now: a registry filled by saved-tensor hooks.

`SavedTensors.recording()` installs a pack/unpack hook pair; every tensor an op saves for backward
while it is on is kept, detached, in a small box that a weak set tracks. Autograd owns the box for as
long as it keeps that saved tensor (until the node that saved it runs its backward or is freed), so
`alive()` after a step is exactly what the step left saved.

The pack hook keeps `tensor.detach()`, never `tensor`: the tensor it receives still carries its
`grad_fn`, so keeping it for a saved *output* makes a reference cycle (node -> saved tensor -> node)
through C++, which `gc.collect()` cannot see. A graph that never runs backward then lives forever,
and the count would report it as held, while without hooks it is freed (torch documents the caveat
with its saved-tensor hooks; detaching is lossless, autograd re-attaches `grad_fn` when unpacking).
"""

import contextlib
import gc
import weakref
from collections.abc import Iterator

import torch


class _Box:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _unpack(box: _Box) -> torch.Tensor:
    return box.tensor


class SavedTensors:
    """Registry of the tensors autograd keeps for backward, among those saved under `recording()`."""

    def __init__(self) -> None:
        self._boxes: weakref.WeakSet[_Box] = weakref.WeakSet()
        self.packed_bytes = 0  # every saved tensor's bytes, ever: proof the hooks saw the work

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record what ops save for backward inside the block (the hooks are thread-local)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> _Box:
        box = _Box(tensor.detach())
        self._boxes.add(box)
        self.packed_bytes += tensor.untyped_storage().nbytes()
        return box

    def alive(self) -> tuple[int, int]:
        """(storages, bytes) still saved for backward after a full garbage collection; each storage
        (several saved views of one tensor, a parameter saved by several ops) counts once."""
        gc.collect()
        storages = {}
        for box in list(self._boxes):
            storage = box.tensor.untyped_storage()
            storages[storage._cdata] = storage.nbytes()
        return len(storages), sum(storages.values())
