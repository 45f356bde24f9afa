"""Exact per-rank gradient memory of FSDP2 modules, by where FSDP2 keeps it (tests and benchmarks)."""

from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Backward", "GradMemory"]


class Backward(TorchDispatchMode):
    """Counts the reducing collectives inside backward, and the gradient bytes held after each op there."""

    def __init__(self, memory: "GradMemory") -> None:
        super().__init__()
        self.memory = memory
        self.counts = {"reduce_scatter": 0, "all_reduce": 0}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch._C._current_graph_task_id() == -1:
            return out
        name = func._overloadpacket.__name__
        if func.namespace in ("c10d", "_c10d_functional"):
            if "reduce_scatter" in name:
                self.counts["reduce_scatter"] += 1
            elif "allreduce" in name or "all_reduce" in name:
                self.counts["all_reduce"] += 1
        self.peak = max(self.peak, sum(self.memory().values()))
        return out


class GradMemory:
    """Bytes of gradient memory a rank holds, each storage once, by where FSDP2 keeps it.

    sharded: the parameters' `.grad` (local shards); unsharded: the gradients autograd accumulates on
    FSDP2's unsharded parameters (`FSDPParam._unsharded_param.grad`) until they are reduced, or all
    along while gradient sync is off (`unsharded_accumulated_grad` too); pending: HSDP's reduce-scattered sum that waits for its
    all-reduce over replicas (`FSDPParamGroup._partial_reduce_output`).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        # Read the sharded parameters from the FSDPParams: in forward and backward FSDP2 registers the
        # unsharded ones on the modules, so model.parameters() would miss the sharded gradients then.
        self.groups = []
        for module in model.modules():
            if isinstance(module, FSDPModule) and (group := module._get_fsdp_state()._fsdp_param_group):
                self.groups.append(group)
        managed = {id(fp.sharded_param) for g in self.groups for fp in g.fsdp_params}
        self.plain = [p for p in model.parameters() if id(p) not in managed]

    def __call__(self) -> dict[str, int]:
        seen: set[int] = set()
        out = {"sharded": 0, "unsharded": 0, "pending": 0}

        def add(kind: str, tensor: torch.Tensor | None) -> None:
            if tensor is None:
                return
            local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
            storage = local.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out[kind] += storage.nbytes()

        for group in self.groups:
            for fsdp_param in group.fsdp_params:
                add("sharded", fsdp_param.sharded_param.grad)
                # Autograd accumulates on the unsharded parameter; torch before 2.15 moves it to
                # `unsharded_accumulated_grad` when the reduce dtype differs, 2.15 reads that name
                # from `_unsharded_param.grad` (the same storage, counted once).
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                add("unsharded", None if unsharded is None else unsharded.grad)
                add("unsharded", fsdp_param.unsharded_accumulated_grad)
            add("pending", group._partial_reduce_output)
        for param in self.plain:
            add("sharded", param.grad)
        return out
