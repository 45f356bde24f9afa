"""The global gradient norm and clipping, over any mix of DTensor placements, meshes and pipeline stages.

Gradients are grouped by (mesh, placements); each group's local sum of |g|^p is all-reduced over
exactly the mesh axes the group is sharded on, so replicated copies count once. Groups are then
combined, and pipeline stages (which hold disjoint parameters) are summed over the pp group. Plain
tensors count as replicated: they add their own norm once. Partial (unreduced) gradients are reduced
first. The result equals the norm of the full gradients in one process. Every rank must call it.

Gradients that FSDP2 keeps on the host (CPU offload) are summed there, and their partial sums are
reduced on the mesh's device (NCCL cannot reduce host tensors), where the result lives too.

A parameter tied across pipeline stages (tied embeddings: the first stage's table, the last stage's
head) has one copy per holding rank, with equal gradients after the pipeline sums them; the copies
other than the first stage's are registered with `register_tied_copy` and left out of the norm, so
the shared parameter counts once. Clipping still scales them, so the copies stay equal.
"""

import math
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["clip_grad_norm_", "grad_norm", "is_tied_copy", "reduce_partial_grads", "register_tied_copy"]

_GroupKey = tuple[DeviceMesh, tuple[object, ...]] | None

#: id → weak reference of the parameters whose gradient another pipeline rank counts (by id: a
#: WeakSet would compare tensors with `==`).
_TIED_COPIES: dict[int, "weakref.ref[torch.Tensor]"] = {}


def register_tied_copy(param: torch.Tensor) -> None:
    """Leave `param` out of `grad_norm`: its gradient equals that of a parameter counted elsewhere.

    `d9d.parallel.pipeline.Pipeline` registers the copies of a tied parameter it keeps in sync.
    """
    key = id(param)
    _TIED_COPIES[key] = weakref.ref(param, lambda _: _TIED_COPIES.pop(key, None))


def is_tied_copy(param: torch.Tensor) -> bool:
    """Whether `param` was registered with `register_tied_copy`."""
    ref = _TIED_COPIES.get(id(param))
    return ref is not None and ref() is param


def reduce_partial_grads(parameters: Iterable[torch.Tensor]) -> int:
    """Reduce every pending-sum (`Partial`) DTensor gradient to its parameter's placements, in place.

    A replicated parameter used on sharded activations (an RMSNorm weight under sequence parallelism,
    a replicated LoRA adapter of a tensor-parallel Linear) gets a `Partial` gradient: each rank
    holds its share of a sum. Left so, the optimizer carries it into its state (SGD's momentum
    buffer: checkpoints cannot hold a Partial DTensor) and reduces it again in every op. Call it after
    backward, before the optimizer step (every rank of the mesh). Returns how many were reduced.
    """
    reduced = 0
    for param in parameters:
        grad = param.grad
        if (
            isinstance(grad, DTensor)
            and isinstance(param, DTensor)
            and any(p.is_partial() for p in grad.placements)
        ):
            param.grad = grad.redistribute(param.device_mesh, param.placements)
            reduced += 1
    return reduced


def grad_norm(
    parameters: Iterable[torch.Tensor],
    *,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | DeviceMesh | None = None,
) -> torch.Tensor:
    """The `norm_type`-norm of all gradients of the model (all stages), as a plain scalar tensor.

    Every rank of the job must call it: the result is made bitwise equal on all ranks (one scalar
    all-reduce over the default group), so replicas scale their gradients identically.

    Args:
        parameters: this rank's parameters (DTensors or plain tensors); those without grad, and tied
            copies (`register_tied_copy`), are skipped.
        norm_type: p of the p-norm; `math.inf` for the max-abs norm.
        pp_group: the pipeline axis (a process group or a 1-D mesh, e.g. `dense["pp"]`) whose ranks
            hold the other stages; None when the model is not split into stages.
    """
    norm_type = float(norm_type)
    is_inf = math.isinf(norm_type)
    grads = [p.grad for p in parameters if p.grad is not None and not is_tied_copy(p)]
    device = _reduce_device(grads)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for key, group in _group_by_spec(grads).items():
        part = _local_part(group, norm_type).to(device)
        if key is not None:
            mesh, placements = key
            for dim, placement in enumerate(placements):
                # Replicated dims hold copies: skip. Any other (Shard, FSDP's strided shard) holds
                # disjoint pieces: combine them (partial grads were reduced in `_local_part`).
                if not (placement.is_replicate() or placement.is_partial()) and mesh.size(dim) > 1:
                    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
                    dist.all_reduce(part, op=op, group=mesh.get_group(dim))
        total = torch.maximum(total, part) if is_inf else total + part
    if pp_group is not None:
        group = pp_group.get_group() if isinstance(pp_group, DeviceMesh) else pp_group
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=group)
    if dist.is_initialized() and dist.get_world_size() > 1:
        # Sums over different groups may round differently; every rank takes the same value.
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return total if is_inf else total ** (1.0 / norm_type)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | DeviceMesh | None = None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale all gradients in place so that their global norm is at most `max_norm`.

    Returns the global norm before clipping (see `grad_norm` for the arguments), the same on every rank.

    Raises:
        RuntimeError: if `error_if_nonfinite` and the norm is nan or inf.
    """
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, norm_type=norm_type, pp_group=pp_group)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the global gradient {norm_type}-norm is {total.item()}; "
            "pass error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for group in _group_by_spec([p.grad for p in params if p.grad is not None]).values():
        torch._foreach_mul_(group, coef.to(group[0].device))
    return total


def _reduce_device(grads: list[torch.Tensor]) -> torch.device:
    """Where the norm is reduced: the device of the first DTensor's mesh (its gradient may live on the
    host under CPU offload), else the first gradient's device."""
    for grad in grads:
        if isinstance(grad, DTensor):
            return torch.device(grad.device_mesh.device_type)
    return grads[0].device if grads else torch.device("cpu")


def _group_by_spec(grads: list[torch.Tensor]) -> dict[_GroupKey, list[torch.Tensor]]:
    """Grads that share a mesh and placements (DTensor), and the plain tensors (key None)."""
    groups: dict[_GroupKey, list[torch.Tensor]] = {}
    for grad in grads:
        key: _GroupKey = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(grad)
    return groups


def _local_part(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """max |g| (inf-norm) or sum |g|^p over this rank's local pieces of `grads`, in float32."""
    local = []
    for grad in grads:
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):  # unreduced: reduce it first
                grad = grad.redistribute(
                    placements=[Replicate() if p.is_partial() else p for p in grad.placements]
                )
            grad = grad.to_local()
        local.append(grad)
    norms = torch._foreach_norm(local, norm_type, dtype=torch.float32) if local else []
    stacked = torch.stack(list(norms))
    return stacked.max() if math.isinf(norm_type) else (stacked**norm_type).sum()
