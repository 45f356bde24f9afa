"""Gathering a state spread over ranks to the writing rank only, one tensor at a time, point to point.

Ranks may hold different keys (pipeline stages: each rank its own layers, under the whole model's
names) and shards of the keys they hold (DTensors over FSDP, TP, EP, ... within a stage). First
every rank reports what it holds to the writer (one `gather_object`): per key its full shape, dtype
and what it can send. The writer merges the ranks' key orders into one (`merge_key_orders`), picks
one sender per piece of every tensor, and tells every rank the merged layout (one broadcast) and
what it sends (one scatter). Then every rank calls `full(key)` for the same keys in the same order.

`DTensor.full_tensor()` is an all-gather: every rank would hold every full tensor. For an export
only the writer needs it, so each piece is sent to the writer alone and the other ranks never hold
more than their own shard. The pieces: a plain tensor is sent whole by the lowest rank holding it
(the writer itself when it holds it: then nothing moves); a DTensor's blocks by the first rank along
every replicated mesh dim (the others hold copies), a block being the local shard's offset and size
in the full tensor as torch.distributed.checkpoint records it (`__create_chunk_list__`), so every
placement DCP can save (Shard, Replicate, FSDP x TP's strided shards) is covered. Partial sums have
no block: every rank holding one reduces it with `full_tensor()` and the lowest of them sends it.
"""

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from d9d.ckpt.io._errors import SafetensorsIOError

__all__ = ["WriterGather", "block_slices", "merge_key_orders"]

_NUMBER = re.compile(r"\d+")

#: (offsets, sizes) of a block of the full tensor.
Block = tuple[tuple[int, ...], tuple[int, ...]]
#: Per key, what one rank holds: (full shape, dtype, what it sends: "whole", "partial", a block,
#: or None for a copy another rank sends or an empty shard).
_Held = tuple[tuple[int, ...], torch.dtype, Any]


def block_slices(block: Block) -> tuple[slice, ...]:
    """The slices of the full tensor that a block covers."""
    offsets, sizes = block
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))


def merge_key_orders(orders: Sequence[Sequence[str]]) -> list[str]:
    """One key order from the ranks' own (each rank's state-dict order), as one process would list it.

    Every rank's order is kept. Where two ranks' next keys compete, a key that differs from the other
    only by a smaller number in the same place comes first (layer 2 before layer 4: a rank holding
    stages 0 and 2 lists layers 0, 1, 4, 5, its neighbour 2, 3, 6, 7); otherwise the lower rank's
    key comes first (with one stage per rank: stage by stage). A key several ranks hold (replicas)
    is listed once, where it first fits.
    """
    chains = [list(order) for order in dict.fromkeys(tuple(order) for order in orders)]  # replicas: once
    positions = [0] * len(chains)
    merged: list[str] = []
    seen: set[str] = set()
    while True:
        heads: list[tuple[int, str]] = []
        for index, chain in enumerate(chains):
            while positions[index] < len(chain) and chain[positions[index]] in seen:
                positions[index] += 1
            if positions[index] < len(chain):
                heads.append((index, chain[positions[index]]))
        if not heads:
            return merged
        unbeaten = [(i, k) for i, k in heads if not any(_numbered_before(o, k) for _, o in heads)]
        index, key = (unbeaten or heads)[0]
        merged.append(key)
        seen.add(key)
        positions[index] += 1


def _numbered_before(a: str, b: str) -> bool:
    """Whether `a` and `b` first differ in a part that is a number in both, and `a`'s is smaller."""
    for part_a, part_b in zip(a.split("."), b.split("."), strict=False):
        if part_a != part_b:
            numbers = _NUMBER.fullmatch(part_a) and _NUMBER.fullmatch(part_b)
            return bool(numbers) and int(part_a) < int(part_b)
    return False


class WriterGather:
    """Full tensors of a state spread over ranks, on the writer; empty placeholders elsewhere.

    Built by every rank together (three object collectives when a process group exists); `layout`
    then lists every key of every rank, in one order, with its full shape and dtype, the same on
    every rank.

    Raises:
        SafetensorsIOError: two ranks hold a key with another shape or dtype (on every rank).
    """

    #: Every key of every rank, in the merged order: its full shape and dtype.
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]]

    def __init__(
        self,
        state: Mapping[str, torch.Tensor],
        writer: int = 0,
        resolve: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """`resolve(key, tensor)`: the tensor to gather for a key, made when it is gathered (same shape,
        dtype and placements as `state[key]`, which stands in for it until then)."""
        self._state = state
        self._resolve = resolve
        self._distributed = dist.is_available() and dist.is_initialized()
        self._writer = writer
        self._rank = dist.get_rank() if self._distributed else writer
        self._device = _home_device(state)
        held = {key: _held(tensor) for key, tensor in state.items()}
        #: On the writer: per key, the pieces to assemble, (rank, block or None for the whole tensor).
        self._pieces: dict[str, list[tuple[int, Block | None]]] = {}
        #: On every other rank: the keys it sends to the writer.
        self._sends: set[str] = set()
        if not self._distributed:
            self.layout = {key: (shape, dtype) for key, (shape, dtype, _) in held.items()}
            self._pieces = {key: [(self._rank, None)] for key in held}
            return
        world = dist.get_world_size()
        tables: list[dict[str, _Held]] | None = [{} for _ in range(world)] if self.is_writer else None
        dist.gather_object(held, tables, dst=writer)
        plan: list[Any] = [None, None]
        sends: list[set[str]] | None = None
        if tables is not None:
            layout, self._pieces, error = _plan(tables)
            plan = [layout, error]
            sends = [set() for _ in range(world)]
            for key, pieces in self._pieces.items():
                for rank, _ in pieces:
                    if rank != writer:
                        sends[rank].add(key)
        dist.broadcast_object_list(plan, src=writer)
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, sends, src=writer)
        layout, error = plan
        if error is not None:
            raise SafetensorsIOError(error)
        self.layout = layout
        self._sends = mine[0]

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes (and so receives the full tensors)."""
        return self._rank == self._writer

    def full(self, key: str) -> torch.Tensor:
        """The full tensor of `key` on CPU on the writer; an empty tensor on every other rank."""
        shape, dtype = self.layout[key]
        tensor = self._state.get(key)
        with torch.no_grad():
            if tensor is not None and self._resolve is not None:
                tensor = self._resolve(key, tensor)
            if isinstance(tensor, DTensor) and not _has_blocks(tensor):
                tensor = tensor.full_tensor()  # partial sums: every holder joins the reduction
            if not self.is_writer:
                if key in self._sends:
                    assert tensor is not None
                    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor.detach()
                    dist.send(local.contiguous().to(self._device), dst=self._writer)
                return torch.empty(0, dtype=dtype)
            pieces = self._pieces[key]
            if pieces == [(self._rank, None)] and tensor is not None and not isinstance(tensor, DTensor):
                return tensor.detach().cpu()  # the writer's own copy: nothing to send or assemble
            return self._assemble(shape, dtype, tensor, pieces)

    def _assemble(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        tensor: torch.Tensor | None,
        pieces: list[tuple[int, Block | None]],
    ) -> torch.Tensor:
        full = torch.empty(shape, dtype=dtype, device="cpu")
        for rank, block in pieces:
            target = full[block_slices(block)] if block is not None else full
            if rank == self._rank:
                assert tensor is not None
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor.detach()
                target.copy_(local.reshape(target.shape))
            elif self._device.type == "cpu" and target.is_contiguous():
                dist.recv(target, src=rank)  # straight into the full tensor
            else:
                buffer = torch.empty(target.shape, dtype=dtype, device=self._device)
                dist.recv(buffer, src=rank)
                target.copy_(buffer)
        return full


def _plan(
    tables: list[dict[str, _Held]],
) -> tuple[
    dict[str, tuple[tuple[int, ...], torch.dtype]], dict[str, list[tuple[int, Block | None]]], str | None
]:
    """On the writer, from every rank's holdings: the merged layout, who sends which piece, an error."""
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    pieces: dict[str, list[tuple[int, Block | None]]] = {}
    for key in merge_key_orders([list(table) for table in tables]):
        holders = [(rank, table[key]) for rank, table in enumerate(tables) if key in table]
        (first, (shape, dtype, _)), *_ = holders
        for rank, (other_shape, other_dtype, _) in holders:
            if (other_shape, other_dtype) != (shape, dtype):
                return (
                    layout,
                    pieces,
                    (
                        f"ranks {first} and {rank} hold {key!r} with other shapes or dtypes "
                        f"({list(shape)} {dtype} vs {list(other_shape)} {other_dtype}): every rank must hold "
                        "the same model's tensors under its names"
                    ),
                )
        layout[key] = (shape, dtype)
        whole = [rank for rank, (_, _, sent) in holders if sent == "whole"]
        partial = [rank for rank, (_, _, sent) in holders if sent == "partial"]
        if whole or partial:
            pieces[key] = [((whole or partial)[0], None)]
            continue
        blocks: dict[Block, int] = {}
        for rank, (_, _, sent) in holders:
            if sent is not None:
                blocks.setdefault(sent, rank)  # the same block on two ranks (stages sharing a key): once
        pieces[key] = [(rank, block) for block, rank in blocks.items()]
    return layout, pieces, None


def _held(tensor: torch.Tensor) -> _Held:
    shape, dtype = tuple(tensor.shape), tensor.dtype
    if not isinstance(tensor, DTensor):
        return shape, dtype, "whole"
    if not _has_blocks(tensor):
        return shape, dtype, "partial"
    return shape, dtype, _own_block(tensor)


def _home_device(state: Mapping[str, torch.Tensor]) -> torch.device:
    """The device this rank's tensors live on (an accelerator when any is), for sends and receives."""
    devices = [t.to_local().device if isinstance(t, DTensor) else t.device for t in state.values()]
    return next((d for d in devices if d.type not in ("cpu", "meta")), torch.device("cpu"))


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
