"""Which slice of a full tensor a rank holds, from the DTensor placements: pure arithmetic."""

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from d9d.ckpt.io._errors import SafetensorsIOError

__all__ = ["dtensor_local_slices", "has_local_slice", "local_part_of_full", "local_slices"]


def local_slices(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> tuple[slice, ...]:
    """The slice of the full tensor held at `coordinate` of a mesh, one slice per tensor dim.

    Shards are applied mesh dim by mesh dim like `torch.chunk`: ceil-sized pieces, the last ones
    shorter or empty. Only `Shard` and `Replicate` placements have a contiguous slice.
    """
    start = [0] * len(global_shape)
    stop = list(global_shape)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:
            raise SafetensorsIOError(
                f"placement {placement!r} has no contiguous local slice; only Shard and Replicate can be "
                "loaded directly (redistribute the parameter, e.g. to Shard(0), before loading)"
            )
        dim = placement.dim % len(global_shape)
        extent = stop[dim] - start[dim]
        pieces = mesh_shape[mesh_dim]
        chunk = -(-extent // pieces)
        lo = min(coordinate[mesh_dim] * chunk, extent)
        hi = min(lo + chunk, extent)
        start[dim], stop[dim] = start[dim] + lo, start[dim] + hi
    return tuple(slice(a, b) for a, b in zip(start, stop, strict=True))


def dtensor_local_slices(tensor: DTensor) -> tuple[slice, ...]:
    """The slice of the full tensor that this rank's local part of `tensor` holds."""
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        raise SafetensorsIOError("this rank is not part of the DTensor's mesh; it holds no slice")
    return local_slices(tensor.shape, tensor.device_mesh.shape, coordinate, tensor.placements)


def has_local_slice(placements: Sequence[Placement]) -> bool:
    """Whether the local part is one contiguous slice of the full tensor (only Shard and Replicate)."""
    return all(isinstance(p, Replicate) or type(p) is Shard for p in placements)


def local_part_of_full(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's local part of `full` laid out as `like`, without collectives.

    A slice for Shard/Replicate; other shardings (e.g. `_StridedShard` of FSDP × TP) are split
    locally by `distribute_tensor(..., src_data_rank=None)`.
    """
    if any(isinstance(p, Partial) for p in like.placements):
        raise SafetensorsIOError(
            f"placements {like.placements} hold partial sums; a loaded value cannot be split"
        )
    if has_local_slice(like.placements):
        return full[dtensor_local_slices(like)]
    full = full.to(like.device)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
