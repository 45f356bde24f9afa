"""Data parallelism on FSDP2: replicate (DDP), fully shard (FSDP) and hybrid (HSDP).

All three are one mechanism, torch's `fully_shard` (and its FSDP2-based `replicate`), so every
parameter becomes a DTensor: checkpoints and the grad norm read placements, not strategies.

Gradient contract: by default gradients are SUMMED over the data-parallel ranks (no division by the
dp size). The caller divides each microbatch's loss by the number of tokens (or samples) in the
GLOBAL batch, so the summed gradient is exactly the gradient of the global-batch mean loss, however
the batch is split over ranks and microbatches. Pass `gradient_reduction="mean"` for torch's usual
averaging instead (then divide by the tokens of the rank's own batch).

CPU offload (`cpu_offload=True`, sharded units only): FSDP2's `CPUOffloadPolicy` keeps every unit's
sharded parameters, gradients and (so) optimizer state on the host, pinned when the mesh is on CUDA;
`fsdp_parameters(module, offloaded=...)` says which parameters live where.
"""

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from d9d.parallel._mesh_axes import axis_names, axis_size, data_axes, sub_mesh
from d9d.parallel.errors import ParallelizeError
from d9d.parallel.precision import MixedPrecision

__all__ = [
    "GradientReduction",
    "ShardUnit",
    "fsdp_parameters",
    "parallelize_fsdp",
    "parallelize_hsdp",
    "parallelize_replicate",
    "set_gradient_accumulation",
    "set_gradient_sync",
]

GradientReduction = Literal["sum", "mean"]

#: One FSDP group of `blocks`: a module, or several sharded together (gathered when the first of them
#: runs, e.g. a tied embedding and LM head, or a final norm with the head).
ShardUnit = nn.Module | Sequence[nn.Module]

#: How `_apply` distributed an FSDP2 unit (stored on it): decides what gradient accumulation may skip.
_KIND_ATTR = "_d9d_data_parallel"


def parallelize_hsdp(
    module: nn.Module,
    mesh: DeviceMesh | None,
    *,
    shard_axis: str = "dp_shard",
    blocks: Sequence[ShardUnit] = (),
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    precision: MixedPrecision | None = None,
    reshard_after_forward: bool | None = None,
    gradient_reduction: GradientReduction = "sum",
    ignored_params: Iterable[nn.Parameter] = (),
    cpu_offload: bool = False,
) -> nn.Module:
    """Fully shard `module` over `shard_axis` and replicate it over the mesh's other data axes.

    Axes of size 1 are skipped, so the same call gives DDP (only a replicate axis > 1), FSDP (only
    the shard axis > 1), HSDP (both) or nothing (a single data-parallel rank). `mesh` may be the whole
    `dense` mesh of a d9d job: its pp and tp axes are never data axes. A `cp` axis (context
    parallelism) shards together with `shard_axis` (one flattened `dp_shard_cp` axis, as its ranks
    hold different tokens), so context parallelism does not multiply parameter memory.

    Args:
        module: the model (or one pipeline stage), parallelized in place and returned.
        mesh: a named device mesh; its data axes are all axes except pp and tp. None (one
            process, e.g. `ParallelizeModelStageContext.mesh` in local mode) leaves the module as is.
        shard_axis: the axis to shard parameters, gradients and optimizer state over.
        blocks: submodules (e.g. transformer blocks, the embedding, `[norm, lm_head]`) sharded as
            their own groups before the root, so only one group's full parameters live at a time;
            an entry may be a list of modules sharded as one group (a tied embedding and LM head
            share a weight, so they must be one). Under DDP (no shard axis) each single module gets
            its own all-reduce and a list of several stays in the root.
        param_dtype: dtype of the gathered parameters in forward/backward (mixed precision).
        reduce_dtype: dtype of gradient reduction.
        precision: both dtypes at once (e.g. the job's `context.precision`); not with the two above.
        reshard_after_forward: free gathered parameters after forward (None: True for blocks, False
            for the root and for the last entry of `blocks`, with which backward starts, so that
            it is not gathered again at once: pass `blocks` in forward order).
        gradient_reduction: "sum" (the d9d contract, see the module docstring) or "mean".
        ignored_params: parameters left alone (e.g. experts sharded by expert parallelism).
        cpu_offload: keep the sharded parameters, gradients and optimizer state of every unit on
            the host (FSDP2's `CPUOffloadPolicy`, pinned on CUDA); build the optimizer after this
            call. Needs a shard axis larger than 1 (offloading replicas would only copy them).

    Raises:
        ParallelizeError: an unknown shard axis, several replicate axes, or `cpu_offload` with
            nothing to shard.
    """
    mp = _policy(precision, param_dtype, reduce_dtype, "parallelize_hsdp")
    if mesh is None:
        _check_offload(cpu_offload, [], "parallelize_hsdp")
        return module
    axes = _active(mesh, data_axes(mesh))
    if shard_axis not in axis_names(mesh):
        raise ParallelizeError(
            f"parallelize_hsdp: shard_axis {shard_axis!r} is not an axis of the mesh {axis_names(mesh)}"
        )
    shard = [a for a in axes if a in (shard_axis, "cp")]  # cp ranks shard with dp_shard (as one axis)
    replicate = [a for a in axes if a not in shard]
    return _apply(
        module,
        mesh,
        shard,
        replicate,
        blocks=blocks,
        mp=mp,
        reshard_after_forward=reshard_after_forward,
        gradient_reduction=gradient_reduction,
        ignored_params=set(ignored_params),
        cpu_offload=_check_offload(cpu_offload, shard, "parallelize_hsdp"),
    )


def parallelize_fsdp(
    module: nn.Module,
    mesh: DeviceMesh | None,
    *,
    axes: Sequence[str] | None = None,
    blocks: Sequence[ShardUnit] = (),
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    precision: MixedPrecision | None = None,
    reshard_after_forward: bool | None = None,
    gradient_reduction: GradientReduction = "sum",
    ignored_params: Iterable[nn.Parameter] = (),
    cpu_offload: bool = False,
) -> nn.Module:
    """Fully shard `module` over all data axes of `mesh` (or over `axes`), flattened into one.

    Arguments as in `parallelize_hsdp`; `axes` defaults to every axis except pp and tp (cp included).
    """
    mp = _policy(precision, param_dtype, reduce_dtype, "parallelize_fsdp")
    if mesh is None:
        _check_offload(cpu_offload, [], "parallelize_fsdp")
        return module
    shard = _active(mesh, _checked_axes(mesh, axes, "parallelize_fsdp"))
    return _apply(
        module,
        mesh,
        shard,
        [],
        blocks=blocks,
        mp=mp,
        reshard_after_forward=reshard_after_forward,
        gradient_reduction=gradient_reduction,
        ignored_params=set(ignored_params),
        cpu_offload=_check_offload(cpu_offload, shard, "parallelize_fsdp"),
    )


def parallelize_replicate(
    module: nn.Module,
    mesh: DeviceMesh | None,
    *,
    axes: Sequence[str] | None = None,
    blocks: Sequence[ShardUnit] = (),
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    precision: MixedPrecision | None = None,
    gradient_reduction: GradientReduction = "sum",
    ignored_params: Iterable[nn.Parameter] = (),
) -> nn.Module:
    """Replicate `module` over all data axes of `mesh` (or over `axes`): DDP on FSDP2's `replicate`.

    Parameters become DTensors with `Replicate()` placements; gradients are all-reduced in backward,
    one bucket per entry of `blocks` and one for the rest. Arguments as in `parallelize_hsdp`.
    """
    mp = _policy(precision, param_dtype, reduce_dtype, "parallelize_replicate")
    if mesh is None:
        return module
    replicate = _active(mesh, _checked_axes(mesh, axes, "parallelize_replicate"))
    return _apply(
        module,
        mesh,
        [],
        replicate,
        blocks=blocks,
        mp=mp,
        reshard_after_forward=None,
        gradient_reduction=gradient_reduction,
        ignored_params=set(ignored_params),
    )


def set_gradient_sync(module: nn.Module, enabled: bool) -> None:
    """Turn gradient reduction of a parallelized module on or off (off: accumulate locally).

    Off keeps *unsharded* gradients on a sharded (FSDP/HSDP) module: for gradient accumulation use
    `set_gradient_accumulation`, which skips communication only where that costs no memory. A
    no-op for a module that `parallelize_*` left unchanged.
    """
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)


def set_gradient_accumulation(module: nn.Module, *, final: bool) -> None:
    """Set up gradient reduction for the next microbatch's backward; `final` for the step's last one.

    On the final microbatch every FSDP2 unit reduces fully. Before it, a unit that only replicates
    (DDP) skips its all-reduce (its gradient is full-size either way) and keeps its unsharded
    compute-dtype parameters for the next microbatch (cast once per step, not per forward), a
    sharded unit (FSDP) reduce-scatters every microbatch into its sharded gradient (so no unsharded
    gradient outlives its block), and a hybrid unit (HSDP) reduce-scatters but defers the all-reduce
    over replicas.
    Units not made by d9d (e.g. expert banks) reduce every microbatch.
    """
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        kind = getattr(sub, _KIND_ATTR, "shard")
        if final:
            sub.set_requires_gradient_sync(True, recurse=False)
            if kind == "replicate":
                sub.set_reshard_after_backward(True, recurse=False)
            if kind == "hybrid":
                sub.set_requires_all_reduce(True, recurse=False)
        elif kind == "replicate":
            sub.set_requires_gradient_sync(False, recurse=False)
            # keep the compute-dtype copy for the next microbatch: one cast per step, not per forward
            sub.set_reshard_after_backward(False, recurse=False)
        else:
            sub.set_requires_gradient_sync(True, recurse=False)
            if kind == "hybrid":
                sub.set_requires_all_reduce(False, recurse=False)


def fsdp_parameters(module: nn.Module, *, offloaded: bool | None = None) -> list[nn.Parameter]:
    """The parameters of `module` that FSDP2 units manage (each once, in `parameters()` order).

    `offloaded=True`: only those whose unit keeps them on the host (`CPUOffloadPolicy`: their
    gradients, and the optimizer state built over them, live there too); `False`: only those it
    keeps on the device; None: all. Works on the meta device, before materialization.
    """
    managed: dict[int, bool] = {}
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            group = _param_group(sub)
            if group is not None:
                host = isinstance(group.offload_policy, CPUOffloadPolicy)
                for fsdp_param in group.fsdp_params:
                    managed[id(fsdp_param.sharded_param)] = host
    found = []
    for param in module.parameters():
        host = managed.get(id(param))
        if host is not None and (offloaded is None or host == offloaded):
            found.append(param)
    return found


def _param_group(unit: FSDPModule) -> Any:
    """The FSDP2 parameter group of one unit (None: a unit without parameters of its own).

    torch keeps the unit's offload policy and its `FSDPParam`s (whose `sharded_param` is the module's
    registered parameter) only there, in the same place from torch 2.6 to 2.15.
    """
    state = unit._get_fsdp_state()
    return state._fsdp_param_group


def _check_offload(cpu_offload: bool, shard: Sequence[str], what: str) -> bool:
    if cpu_offload and not shard:
        raise ParallelizeError(
            f"{what}: cpu_offload=True needs a shard axis larger than 1 (FSDP2 offloads sharded units "
            "only); shard the parameters (dp_shard or cp > 1) or pass cpu_offload=False"
        )
    return cpu_offload


def _offload_policy(mesh: DeviceMesh, cpu_offload: bool) -> OffloadPolicy:
    """FSDP2's host offload, pinned where there is a device to copy from (CUDA); none otherwise."""
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")


def _policy(
    precision: MixedPrecision | None,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    what: str,
) -> MixedPrecisionPolicy:
    if precision is not None:
        if param_dtype is not None or reduce_dtype is not None:
            raise ParallelizeError(f"{what}: pass either precision= or param_dtype=/reduce_dtype=, not both")
        if not precision.enabled and precision.reduce_dtype == torch.float32:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype)
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def _checked_axes(mesh: DeviceMesh, axes: Sequence[str] | None, what: str) -> tuple[str, ...]:
    if axes is None:
        return data_axes(mesh)
    names = axis_names(mesh)
    unknown = [a for a in axes if a not in names]
    if unknown:
        raise ParallelizeError(f"{what}: axes {unknown} are not axes of the mesh {names}")
    return tuple(a for a in names if a in axes)  # mesh order, as slicing requires


def _active(mesh: DeviceMesh, axes: Sequence[str]) -> list[str]:
    return [a for a in axes if axis_size(mesh, a) > 1]


def _apply(
    module: nn.Module,
    mesh: DeviceMesh,
    shard: list[str],
    replicate: list[str],
    *,
    blocks: Sequence[ShardUnit],
    mp: MixedPrecisionPolicy,
    reshard_after_forward: bool | None,
    gradient_reduction: GradientReduction,
    ignored_params: set[nn.Parameter],
    cpu_offload: bool = False,
) -> nn.Module:
    if gradient_reduction not in ("sum", "mean"):
        raise ParallelizeError(f"gradient_reduction must be 'sum' or 'mean', got {gradient_reduction!r}")
    if not shard and not replicate:
        return module  # one data-parallel rank: nothing to synchronize
    ignored = ignored_params or None
    if shard:
        if replicate:
            if len(replicate) > 1:
                raise ParallelizeError(
                    f"HSDP needs exactly one replicate axis larger than 1, got replicate {replicate} "
                    f"and shard {shard}"
                )
            dp_mesh = _hybrid_mesh(mesh, replicate[0], shard)
        else:
            dp_mesh = sub_mesh(mesh, shard)
        kind = "hybrid" if replicate else "shard"
        offload = _offload_policy(mesh, cpu_offload)
        for index, block in enumerate(blocks):
            last = index == len(blocks) - 1
            fully_shard(
                block if isinstance(block, nn.Module) else list(block),
                mesh=dp_mesh,
                reshard_after_forward=(not last) if reshard_after_forward is None else reshard_after_forward,
                mp_policy=mp,
                offload_policy=offload,
                ignored_params=ignored,
            )
        fully_shard(
            module,
            mesh=dp_mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp,
            offload_policy=offload,
            ignored_params=ignored,
        )
    else:
        kind = "replicate"
        from torch.distributed._composable.replicate_with_fsdp import replicate as fsdp_replicate

        dp_mesh = sub_mesh(mesh, replicate)
        single = [b if isinstance(b, nn.Module) else b[0] for b in blocks if _size(b) == 1]
        for block in single:  # one all-reduce per block, overlapping the rest of backward
            fsdp_replicate(block, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored)
        blocks = single  # replicate takes one module: a group of several stays in the root
        fsdp_replicate(module, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored)
    for unit in (*blocks, module):
        for part in [unit] if isinstance(unit, nn.Module) else unit:
            setattr(part, _KIND_ATTR, kind)
    _set_reduction(module, gradient_reduction)
    return module


def _size(unit: ShardUnit) -> int:
    return 1 if isinstance(unit, nn.Module) else len(unit)


def _hybrid_mesh(mesh: DeviceMesh, replicate: str, shard: Sequence[str]) -> DeviceMesh:
    """The 2-D (replicate, shard) mesh of HSDP; several shard axes (dp_shard, cp) become one."""
    names = (replicate, *shard)
    sliced = mesh if axis_names(mesh) == names else mesh[names]
    if len(shard) == 1:
        return sliced
    shard_name = "_".join(shard)
    sizes = (axis_size(mesh, replicate), sliced.size() // axis_size(mesh, replicate))
    return sliced._flatten("_".join(names))._unflatten(0, sizes, (replicate, shard_name))


def _set_reduction(module: nn.Module, gradient_reduction: GradientReduction) -> None:
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            # Sum-type collectives with explicit scaling run on every backend (gloo has no PREMUL_SUM).
            sub.set_force_sum_reduction_for_comms(True)
            if gradient_reduction == "sum":
                sub.set_gradient_divide_factor(1.0)
