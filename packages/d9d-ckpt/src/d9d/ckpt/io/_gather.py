"""Gathering DTensors to the writing rank only, one tensor at a time, point to point.

`DTensor.full_tensor()` is an all-gather: every rank would hold every full tensor. For an export only
the writer needs it, so each shard is sent to the writer alone and the other ranks never hold more
than their own shard. Which rank sends which block: the first rank along every replicated mesh dim
(the others hold copies); a block is the local shard's offset and size in the full tensor, as
torch.distributed.checkpoint records it (`__create_chunk_list__`), so every placement DCP can save
(Shard, Replicate, FSDP x TP's strided shards) is covered. Partial sums have no block: such a
tensor is reduced with `full_tensor()` on every rank.
"""

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

__all__ = ["WriterGather", "block_slices"]

#: (offsets, sizes) of a block of the full tensor.
Block = tuple[tuple[int, ...], tuple[int, ...]]


def block_slices(block: Block) -> tuple[slice, ...]:
    """The slices of the full tensor that a block covers."""
    offsets, sizes = block
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))


class WriterGather:
    """Full tensors of a (possibly sharded) state on the writer; empty placeholders elsewhere.

    Built by every rank together (one `gather_object` of the blocks each rank will send); then every
    rank calls `full(key)` for the same keys in the same order.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], keys: Sequence[str], writer: int = 0) -> None:
        self._state = state
        self._distributed = dist.is_available() and dist.is_initialized()
        self._writer = writer
        self._rank = dist.get_rank() if self._distributed else writer
        self._sent: dict[str, Block] = {}
        for key in keys:
            tensor = state[key]
            if isinstance(tensor, DTensor) and _has_blocks(tensor):
                block = _own_block(tensor)
                if block is not None:
                    self._sent[key] = block
        self._senders: dict[str, list[tuple[int, Block]]] = {}
        if self._distributed and any(isinstance(state[k], DTensor) for k in keys):
            table: list[dict[str, Block]] | None = (
                [{} for _ in range(dist.get_world_size())] if self.is_writer else None
            )
            dist.gather_object(self._sent, table, dst=writer)
            for rank, blocks in enumerate(table or []):
                for key, block in blocks.items():
                    self._senders.setdefault(key, []).append((rank, block))

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes (and so receives the full tensors)."""
        return self._rank == self._writer

    def full(self, key: str) -> torch.Tensor:
        """The full tensor of `key` on CPU on the writer; an empty tensor on every other rank."""
        tensor = self._state[key]
        with torch.no_grad():
            if not isinstance(tensor, DTensor):
                return tensor.detach().cpu() if self.is_writer else tensor.new_empty(0)
            if not _has_blocks(tensor):  # partial sums: only a reduction gives the values
                full = tensor.full_tensor()
                return full.cpu() if self.is_writer else full.new_empty(0)
            if not self.is_writer:
                block = self._sent.get(key)
                if block is not None:
                    dist.send(tensor.to_local().contiguous(), dst=self._writer)
                return torch.empty(0, dtype=tensor.dtype)
            return self._receive(key, tensor)

    def _receive(self, key: str, tensor: DTensor) -> torch.Tensor:
        local = tensor.to_local()
        full = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        for rank, block in self._senders.get(key, []):
            target = full[block_slices(block)]
            if rank == self._rank:
                target.copy_(local.reshape(target.shape))
            elif local.device.type == "cpu" and target.is_contiguous():
                dist.recv(target, src=rank)  # straight into the full tensor
            else:
                buffer = torch.empty(block[1], dtype=tensor.dtype, device=local.device)
                dist.recv(buffer, src=rank)
                target.copy_(buffer)
        return full


def _has_blocks(tensor: DTensor) -> bool:
    return not any(isinstance(p, Partial) for p in tensor.placements)


def _own_block(tensor: DTensor) -> Block | None:
    """This rank's block when it is the one to send it (first along replicated dims, non-empty)."""
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    if any(isinstance(p, Replicate) and c != 0 for p, c in zip(tensor.placements, coordinate, strict=True)):
        return None
    (chunk,) = tensor.__create_chunk_list__()
    block = (tuple(chunk.offsets), tuple(chunk.sizes))
    return block if all(s > 0 for s in block[1]) else None
