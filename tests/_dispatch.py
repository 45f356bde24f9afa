"""Dispatch modes that watch what a CUDA run would do, on CPU: matmul and reduction dtypes, host syncs,
parameter casts, float8 scale reductions."""

import math
from collections import Counter
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from d9d.mesh.testing import HostSyncCounter

#: Matmul-like aten ops (by overload packet name) whose input dtypes the precision tests check.
MATMULS = ("mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "_grouped_mm")
#: Collectives that reduce (c10d and functional ones).
REDUCTIONS = ("reduce_scatter", "allreduce", "all_reduce")


class OpRecorder(HostSyncCounter):
    """Records (op name, input dtypes) of matmuls and (op name, input dtypes, inside backward, input
    shapes) of reducing collectives, and counts host syncs as `d9d.mesh.testing.HostSyncCounter`
    does (`host_syncs`)."""

    def __init__(self) -> None:
        super().__init__()
        self.matmuls: list[tuple[str, tuple[torch.dtype, ...]]] = []
        self.reductions: list[tuple[str, tuple[torch.dtype, ...], bool, tuple[tuple[int, ...], ...]]] = []

    @property
    def host_syncs(self) -> int:
        """Host syncs a CUDA run would make, so far."""
        return self.count

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._overloadpacket.__name__
        tensors = _tensors(args) + _tensors(kwargs or {})
        dtypes = tuple(t.dtype for t in tensors if t.is_floating_point())
        if name in MATMULS or "scaled_dot_product" in name:
            self.matmuls.append((name, dtypes))
        elif any(r in name for r in REDUCTIONS):
            shapes = tuple(tuple(t.shape) for t in tensors if t.is_floating_point())
            self.reductions.append((name, dtypes, torch._C._current_graph_task_id() != -1, shapes))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class ParamCasts(TorchDispatchMode):
    """Counts the copies that change a parameter's dtype (`aten._to_copy`, `aten.copy_` whose source is
    a parameter's storage, a DTensor's local one), by parameter name, and the bytes they wrote (this
    rank's)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.names = {_storage(p): name for name, p in model.named_parameters()}
        self.counts: Counter[str] = Counter()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if name in ("_to_copy", "copy_"):
            source, written = (args[0], out) if name == "_to_copy" else (args[1], args[0])
            if isinstance(source, torch.Tensor) and source.dtype != written.dtype:
                param = self.names.get(_storage(source))
                if param is not None:
                    self.counts[param] += 1
                    local = written.to_local() if isinstance(written, DTensor) else written
                    self.bytes += local.numel() * local.element_size()
        return out


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    try:
        return local.untyped_storage().data_ptr()
    except RuntimeError:  # a wrapper subclass without storage of its own (e.g. a functional collective's)
        return -1


class Float8ScaleReductions(TorchDispatchMode):
    """Counts the all-reduces of one weight's absolute maximum (torchao's dynamic scale at each float8
    all-gather: a 0-dim all-reduce) and the `_foreach_norm`s (inf) that compute all weights' at once."""

    def __init__(self) -> None:
        super().__init__()
        self.per_weight = 0
        self.all_weights: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._overloadpacket.__name__
        if name == "all_reduce" and args[0].dim() == 0:
            self.per_weight += 1
        elif name == "_foreach_norm" and args[1] == math.inf:
            self.all_weights.append(len(args[0]))
        return func(*args, **(kwargs or {}))
