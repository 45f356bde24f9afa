"""`parallelize_expert_parallel`: shard the experts of every `MoE` over the `ep_shard` axis.

Layout (the `expert` domain of d9d.mesh is (pp, ep_replicate, ep_shard)): rank r of `ep_shard` holds
experts [r·E/ep, (r+1)·E/ep) as DTensors with `Shard(0)` on that axis; tokens reach them through
all-to-all. The router and the shared expert stay whole on every rank: they are dense parameters,
reduced by whatever data parallelism the caller applies to the rest of the model.

Gradients (the d9d contract: each rank's loss is normalised by the global token count and gradients
are summed over data-parallel ranks). An expert's gradient on its owner already holds the
contributions of every token of its ep group (the all-to-all's backward brings them). What is left
is the sum over `ep_replicate`, the ranks holding copies of the same experts: this function applies
FSDP2 `fully_shard` to each `GroupedExperts` over `ep_replicate` with a divide factor of 1 (a sum).
With `ep_replicate` of size 1 that is a no-op numerically, but it also marks the experts as managed,
so that a later `fully_shard` of the whole model (data parallelism over the dense mesh) leaves them
alone instead of reducing them a second time over ranks that hold different experts.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from d9d.mesh import DistributedContext
from d9d.parallel._mesh_axes import sub_mesh
from d9d.parallel.errors import UnsupportedParallelismError
from d9d.parallel.expert.dispatch import AllToAllDispatcher
from d9d.parallel.expert.errors import ExpertParallelError
from d9d.parallel.expert.experts import GroupedExperts
from d9d.parallel.expert.moe import MoE
from d9d.parallel.precision import MixedPrecision

__all__ = ["parallelize_expert_parallel"]

_EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def parallelize_expert_parallel(
    module: nn.Module,
    mesh: DistributedContext | DeviceMesh,
    *,
    shard_expert_replicas: bool = True,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    precision: MixedPrecision | None = None,
) -> nn.Module:
    """Shard the experts of every `MoE` in `module` over ep and dispatch tokens with all-to-all.

    Call it before applying data parallelism to the rest of the model. In local mode (a context with
    all degrees 1) the module is returned unchanged and computes without collectives.

    Args:
        module: an `MoE` or a model containing `MoE` layers; changed in place.
        mesh: the job's `DistributedContext` (the load-balance statistics are then taken over its
            data- and context-parallel ranks), or its `expert` device mesh (axes ep_replicate and
            ep_shard, optionally pp). With a mesh, every rank of it is assumed to hold different
            tokens (no tensor or context parallelism).
        shard_expert_replicas: fully_shard each expert bank over `ep_replicate`, summing gradients
            (see the module docstring). Turn it off only to reduce expert gradients yourself.
        reshard_after_forward: FSDP2 option for the expert banks.
        mp_policy: FSDP2 mixed-precision policy for the expert banks.
        precision: the job's mixed precision (e.g. `context.precision`), instead of `mp_policy`.

    Returns:
        `module`.

    Raises:
        ExpertParallelError: no `MoE` in `module`, experts not divisible by ep, or already parallelized.
        UnsupportedParallelismError: a context with tensor or context parallelism (not supported yet).
    """
    mp_policy = _policy_from_precision(mp_policy, precision)
    moes = _moe_layers(module)
    if isinstance(mesh, DistributedContext) and mesh.is_local:
        return module
    expert_mesh, stats_group = _expert_mesh_and_stats_group(mesh)
    ep_mesh = _ep_shard_mesh(expert_mesh)
    _check_layers(moes, ep_mesh.size())  # every layer before changing any
    for moe in moes:
        moe.stats_group = stats_group
        if ep_mesh.size() == 1:
            continue  # experts are dense parameters: the caller's data parallelism handles them
        _shard_experts(moe.experts, ep_mesh)
        moe.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), moe.num_experts)
        if shard_expert_replicas and "ep_replicate" in (expert_mesh.mesh_dim_names or ()):
            fully_shard(
                moe.experts,
                mesh=expert_mesh["ep_replicate"],
                reshard_after_forward=reshard_after_forward,
                mp_policy=mp_policy or MixedPrecisionPolicy(),
            )
            _sum_gradients(moe.experts)
    return module


def _policy_from_precision(
    mp_policy: MixedPrecisionPolicy | None, precision: MixedPrecision | None
) -> MixedPrecisionPolicy | None:
    """The FSDP2 policy for the expert banks: `mp_policy`, or the one the job's `precision` implies."""
    if precision is None:
        return mp_policy
    if mp_policy is not None:
        raise ExpertParallelError("pass either precision= or mp_policy=, not both")
    if precision.enabled or precision.reduce_dtype != torch.float32:
        return MixedPrecisionPolicy(param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype)
    return None


def _moe_layers(module: nn.Module) -> list[MoE]:
    """Every `MoE` in `module` (itself included); none is an error."""
    moes = [m for m in module.modules() if isinstance(m, MoE)]
    if not moes:
        raise ExpertParallelError(
            f"{type(module).__name__} contains no d9d.parallel.expert.MoE layer to parallelize"
        )
    return moes


def _expert_mesh_and_stats_group(
    mesh: DistributedContext | DeviceMesh,
) -> tuple[DeviceMesh, dist.ProcessGroup | None]:
    """The expert mesh, and the group over which the load-balance statistics are summed."""
    if not isinstance(mesh, DistributedContext):
        return mesh, _token_group(mesh)
    _check_supported(mesh)
    batch_mesh = mesh.mesh("batch")  # dp and cp ranks hold different tokens (tp ranks share theirs)
    axes = [axis for axis in ("dp", "cp") if batch_mesh[axis].size() > 1]
    return mesh.mesh("expert"), sub_mesh(batch_mesh, axes).get_group() if axes else None


def _ep_shard_mesh(expert_mesh: DeviceMesh) -> DeviceMesh:
    """The `ep_shard` axis of the expert mesh, which the experts are split over."""
    names = expert_mesh.mesh_dim_names or ()
    if "ep_shard" not in names:
        raise ExpertParallelError(
            f"the expert mesh must have an 'ep_shard' axis, got axes {names}; pass ctx.mesh('expert')"
        )
    return expert_mesh["ep_shard"]


def _check_layers(moes: list[MoE], ep_size: int) -> None:
    """Refuse layers whose experts do not split evenly over `ep_size` ranks, or are already split."""
    for moe in moes:
        if moe.num_experts % ep_size != 0:
            raise ExpertParallelError(
                f"num_experts={moe.num_experts} is not divisible by expert_parallel={ep_size}; "
                f"set mesh.expert_parallel to a divisor of {moe.num_experts}"
            )
        if isinstance(moe.experts.w_gate, DTensor):
            raise ExpertParallelError(
                "this MoE layer is already parallelized; call parallelize_expert_parallel once"
            )


def _sum_gradients(module: nn.Module) -> None:
    """Make FSDP sum gradients instead of averaging them (plain SUM collectives: gloo has no PREMUL_SUM)."""
    assert isinstance(module, FSDPModule)
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


def _check_supported(ctx: DistributedContext) -> None:
    config = ctx.config
    if config.tensor_parallel > 1:  # tp ranks share their tokens: the all-to-all would route them twice
        raise UnsupportedParallelismError(
            "expert parallelism with tensor_parallel > 1 is not supported yet "
            f"(mesh: {config.describe_degrees()}); use expert_parallel with data or context parallelism"
        )


def _token_group(expert_mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The ranks of this pipeline stage, which all hold different tokens (load-balance statistics)."""
    names = expert_mesh.mesh_dim_names or ()
    axes = [a for a in ("ep_replicate", "ep_shard") if a in names and expert_mesh[a].size() > 1]
    if not axes:
        return None
    if len(axes) == 1:
        return expert_mesh[axes[0]].get_group()
    return expert_mesh["ep_replicate", "ep_shard"]._flatten("ep_tokens").get_group()


def _shard_experts(experts: GroupedExperts, ep_mesh: DeviceMesh) -> None:
    """Replace each stacked expert weight by a DTensor holding only this rank's experts (Shard(0))."""
    rank, size = ep_mesh.get_local_rank(), ep_mesh.size()
    for name in _EXPERT_WEIGHTS:
        full = getattr(experts, name)
        per_rank = full.shape[0] // size
        local = full.detach()[rank * per_rank : (rank + 1) * per_rank].clone()
        sharded = DTensor.from_local(
            local, ep_mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
        setattr(experts, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
