"""A model's weights as an export would write them, streamed in buckets instead of files: what an
inference engine's weight update (vLLM's `load_weights`, SGLang's `update_weights_from_tensor`) loads.
"""

import functools
import math
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.ckpt.io._errors import SafetensorsIOError
from d9d.ckpt.io._gather import WriterGather
from d9d.ckpt.io._layout import plan_shards
from d9d.ckpt.io._state import as_state, mapped_groups
from d9d.ckpt.mapper._base import StateMapper
from d9d.ckpt.mapper._check import OnUnused

__all__ = ["StreamDestination", "stream_weights"]

#: Who receives the tensors: global rank 0, or every rank.
StreamDestination = Literal["rank0", "all"]

DEFAULT_BUCKET_BYTES = 512 * 2**20


@dataclass(frozen=True)
class _Entry:
    """One output tensor of the mapper: its group, name, shape and the dtype it is streamed in."""

    group: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def stream_weights(
    source: nn.Module | Mapping[str, torch.Tensor],
    *,
    mapper: StateMapper | None = None,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    destination: StreamDestination = "rank0",
    keep_dtype: Collection[str] = (),
    unused: OnUnused = "error",
    resolve: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The tensors `save_safetensors` would write (same names, shapes, order), in buckets.

    The tensors never share memory with `source` (a snapshot, whatever trains next). Every rank calls it
    with its own part of the state, as for `save_safetensors` (its shards of
    DTensors; on a pipeline-parallel mesh only its stages' keys, under the whole model's names), and
    iterates it to the end: the buckets are collectives. Each bucket is a list of (name, tensor) on
    the CPU whose bytes stay within `bucket_bytes` (a tensor larger than that is a bucket of its
    own); every rank iterates the same number of buckets, and the ranks that do not receive get
    empty lists. The full tensors are assembled on global rank 0 only, one mapper group at a time,
    each piece sent there by the one rank chosen to send it (`WriterGather`, the export's own path);
    with `destination="all"` rank 0 then broadcasts each bucket. Rank 0 holds at most one bucket
    plus one group's full tensors being assembled; a rank that receives nothing, none of them.

    Args:
        source: a module (its `state_dict()`) or a mapping of names to tensors or DTensors.
        mapper: maps source keys to the engine's keys (the export mapper); identity when None.
        dtype: the floating dtype every output is cast to, except those of groups reading a key of
            `keep_dtype`; None keeps the mapper's dtypes.
        bucket_bytes: the most bytes of one bucket (in the streamed dtypes).
        destination: "rank0" (global rank 0 receives) or "all" (every rank does).
        keep_dtype: source keys (buffers) whose outputs keep their own dtype.
        unused: what to do about source keys the mapper does not consume.
        resolve: `resolve(key, tensor)` gives the tensor to stream for a key of `source`, made as the
            key is gathered (same shape, dtype and placements): e.g. a LoRA weight merged with its
            adapter (`d9d.parallel.lazily_merged_state`), so merged weights exist one at a time. Every
            rank holding the key calls it, in one order (it may run collectives).

    Raises:
        SafetensorsIOError: a bucket size that is not positive, an unknown destination, a dtype that
            is not floating, or ranks that hold one key with other shapes or dtypes.
        MappingError: the mapper does not fit the keys of all ranks together.
    """
    _check_arguments(dtype, bucket_bytes, destination)
    state = as_state(source)
    gather = functools.partial(WriterGather, state, resolve=resolve)
    return _stream(
        gather, _storages(state), mapper, dtype, bucket_bytes, destination, frozenset(keep_dtype), unused
    )


def _check_arguments(dtype: torch.dtype | None, bucket_bytes: int, destination: str) -> None:
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise SafetensorsIOError(
            f"bucket_bytes must be a positive number of bytes, got {bucket_bytes!r}; e.g. 512 * 2**20"
        )
    if destination not in ("rank0", "all"):
        raise SafetensorsIOError(f"destination must be 'rank0' or 'all', got {destination!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise SafetensorsIOError(
            f"dtype {dtype} is not a floating dtype; pass e.g. torch.bfloat16, or None to keep the weights'"
        )


def _stream(
    make_gather: Callable[[], WriterGather],
    live: set[int],
    mapper: StateMapper | None,
    dtype: torch.dtype | None,
    bucket_bytes: int,
    destination: StreamDestination,
    keep_dtype: frozenset[str],
    unused: OnUnused,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    gather = make_gather()  # every rank's keys, shapes and dtypes, in one order (collectives: on first use)
    mapper, groups, outputs = mapped_groups(gather.layout, mapper, unused)
    entries = [
        _Entry(gi, name, tuple(meta.shape), _streamed_dtype(meta.dtype, dtype, groups[gi].inputs, keep_dtype))
        for gi, metas in enumerate(outputs)
        for name, meta in metas.items()
    ]
    buckets = plan_shards([e.nbytes for e in entries], bucket_bytes) if entries else []
    broadcast = destination == "all" and dist.is_initialized() and dist.get_world_size() > 1
    receives = gather.is_writer or destination == "all"
    mapped: tuple[int, dict[str, torch.Tensor]] = (-1, {})  # the group whose outputs are held
    for bucket in buckets:
        tensors: list[tuple[str, torch.Tensor]] = []
        for entry in (entries[i] for i in bucket):
            if mapped[0] != entry.group:
                mapped = (-1, {})  # the previous group's outputs go before this one's inputs come
                group = groups[entry.group]
                inputs = {k: gather.full(k) for k in sorted(group.inputs)}
                mapped = (entry.group, mapper.apply(inputs) if gather.is_writer else {})
                del inputs
            tensor = mapped[1].get(entry.name)
            if tensor is not None:
                tensor = tensor.detach().to(entry.dtype)
                if tensor.untyped_storage().data_ptr() in live:  # the model's own memory: a snapshot
                    tensor = tensor.clone()
            if broadcast:
                tensor = _broadcast(tensor, entry, gather.is_writer)
            if receives:
                assert tensor is not None
                tensors.append((entry.name, tensor))
        yield tensors
    del mapped


def _storages(state: Mapping[str, torch.Tensor]) -> set[int]:
    """The addresses of the state's (local) storages, which a streamed tensor must not share."""
    return {
        (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()
        for t in state.values()
        if t.device.type != "meta"
    }


def _streamed_dtype(
    mapped: torch.dtype, dtype: torch.dtype | None, inputs: frozenset[str], keep: frozenset[str]
) -> torch.dtype:
    """The dtype an output is streamed in: `dtype` for floating outputs of parameters, else its own."""
    if dtype is None or not mapped.is_floating_point or inputs & keep:
        return mapped
    return dtype


def _broadcast(tensor: torch.Tensor | None, entry: _Entry, sender: bool) -> torch.Tensor:
    """`tensor` from global rank 0 on every rank, on the CPU, through the process group's device.

    Sent as bytes (a uint8 view), so any dtype goes through any backend (gloo has no float8).
    """
    device = _collective_device()
    if sender:
        assert tensor is not None
        data = tensor.contiguous().reshape(-1).view(torch.uint8).to(device)
    else:
        data = torch.empty(entry.nbytes, dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0)
    if sender:
        assert tensor is not None
        return tensor
    return data.cpu().view(entry.dtype).reshape(entry.shape)


def _collective_device() -> torch.device:
    """The device the default process group's collectives take (the current CUDA device under nccl)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
