"""Dispatch modes that watch what a CUDA run would do, on CPU: matmul and reduction dtypes, host syncs."""

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Matmul-like aten ops (by overload packet name) whose input dtypes the precision tests check.
MATMULS = ("mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "_grouped_mm")
#: Collectives that reduce (c10d and functional ones).
REDUCTIONS = ("reduce_scatter", "allreduce", "all_reduce")


class OpRecorder(TorchDispatchMode):
    """Records (op name, input dtypes, inside backward) of matmuls and reducing collectives, and counts
    host syncs: `_local_scalar_dense` (every `.item()`, `float(t)`, `bool(t)`) and `Tensor.tolist()`
    (which on a CPU tensor reads memory without dispatching any op, so it is counted where it is called)."""

    def __init__(self) -> None:
        super().__init__()
        self.matmuls: list[tuple[str, tuple[torch.dtype, ...]]] = []
        self.reductions: list[tuple[str, tuple[torch.dtype, ...], bool]] = []
        self.host_syncs = 0

    def __enter__(self) -> "OpRecorder":
        self._tolist = torch.Tensor.tolist
        recorder = self

        def tolist(tensor: torch.Tensor) -> Any:
            recorder.host_syncs += 1
            return recorder._tolist(tensor)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._overloadpacket.__name__
        tensors = _tensors(args) + _tensors(kwargs or {})
        dtypes = tuple(t.dtype for t in tensors if t.is_floating_point())
        if name in MATMULS or "scaled_dot_product" in name:
            self.matmuls.append((name, dtypes))
        elif any(r in name for r in REDUCTIONS):
            self.reductions.append((name, dtypes, torch._C._current_graph_task_id() != -1))
        elif name == "_local_scalar_dense":
            self.host_syncs += 1
        return func(*args, **(kwargs or {}))


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
