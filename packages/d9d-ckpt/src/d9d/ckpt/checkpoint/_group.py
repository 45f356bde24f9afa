"""The few collectives checkpointing needs, over one process group or as no-ops in one process."""

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CheckpointGroup"]


class CheckpointGroup:
    """Collectives of the checkpoint code on its own gloo group (None: one process, no-ops).

    A separate group lets an asynchronous save run its collectives in a background thread while the
    training loop keeps using the default group.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1

    @classmethod
    def create(cls, distributed: bool) -> "CheckpointGroup":
        """A new gloo group over every rank (collective: all ranks call it together), or none."""
        return cls(dist.new_group(backend="gloo") if distributed else None)

    @property
    def is_local(self) -> bool:
        """True when there is no process group (one plain process)."""
        return self.group is None

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, indexed by rank."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def any_true(self, flags: torch.Tensor) -> torch.Tensor:
        """Element-wise OR of a bool vector over all ranks."""
        if self.group is None:
            return flags
        buf = flags.to(torch.uint8)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        return buf.bool()

    def destroy(self) -> None:
        """Release the group (safe to call twice)."""
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None
