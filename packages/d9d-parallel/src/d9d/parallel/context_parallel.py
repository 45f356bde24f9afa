"""Context parallelism: split every sequence over the `cp` ranks and compute exact causal attention.

Layout (load-balanced): a sequence of `seq_len` tokens is cut into `2·cp` equal chunks and rank `r`
holds chunks `r` and `2·cp−1−r`, concatenated in that order. Under a causal mask a late chunk costs
more than an early one; pairing chunk `r` with its mirror gives every rank the same number of
(query, key) pairs, so no rank waits for another.

Attention (`context_parallel_attention`): K and V are all-gathered over the cp group (one collective
for both, autograd-aware: their gradients are reduce-scattered back to the owning ranks), reordered
into global order, and each of the rank's two query chunks (global chunk `c`, length `L`) attends to
keys `[0, (c+1)·L)` under a lower-right-aligned causal mask. Every other activation of the model
stays at `seq_len / cp` tokens per rank.
"""

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right

from d9d.parallel._mesh_axes import axis_names, axis_size
from d9d.parallel._torch_compat import all_gather_autograd
from d9d.parallel.errors import ParallelizeError

__all__ = [
    "ContextParallel",
    "SequenceLengthError",
    "SequenceShare",
    "check_sequence_length",
    "context_parallel_attention",
    "context_parallel_of",
    "meta_attention_as",
    "parallelize_context_parallel",
    "recording_gathered_keys_values",
    "sequence_length_problem",
]

_META_AS: ContextVar[str] = ContextVar("d9d_cp_meta_attention_as", default="meta")
_GATHERED: ContextVar["list[torch.Tensor] | None"] = ContextVar("d9d_cp_gathered", default=None)


@contextlib.contextmanager
def meta_attention_as(device_type: str) -> Iterator[None]:
    """Within it, context-parallel attention on meta tensors (a plan's estimate) takes the path it
    takes on `device_type`: "cpu" pads each query chunk to a square (what a CPU run saves for
    backward); any other keeps the meta path, whose SDPA call a plan counts as the fused kernels of
    CUDA save."""
    token = _META_AS.set(device_type)
    try:
        yield
    finally:
        _META_AS.reset(token)


@contextlib.contextmanager
def recording_gathered_keys_values() -> Iterator[list[torch.Tensor]]:
    """Within it, the full-length K and V every context-parallel attention all-gathers are appended to
    the list it yields (a plan counts what of them backward keeps: `saved_activation_bytes_among`)."""
    gathered: list[torch.Tensor] = []
    token = _GATHERED.set(gathered)
    try:
        yield gathered
    finally:
        _GATHERED.reset(token)


class SequenceLengthError(ParallelizeError):
    """A sequence length that context parallelism cannot cut into 2·cp equal chunks (the message names
    where the length came from and how to change it)."""


@dataclass(frozen=True)
class SequenceShare:
    """One cp rank's share of a sequence in the load-balanced layout (pure arithmetic).

    Attributes:
        seq_len: tokens of the whole sequence.
        context_parallel: ranks sharing it (cp).
        rank: the cp rank.
    """

    seq_len: int
    context_parallel: int
    rank: int

    @property
    def num_chunks(self) -> int:
        """Equal chunks the sequence is cut into: 2·cp (1 without context parallelism)."""
        return 2 * self.context_parallel if self.context_parallel > 1 else 1

    @property
    def chunks(self) -> tuple[int, ...]:
        """The global chunks this rank holds, in the order it holds them: (r, 2·cp−1−r)."""
        if self.context_parallel == 1:
            return (0,)
        return _chunk_ids(self.context_parallel, self.rank)

    @property
    def chunk_tokens(self) -> int:
        """Tokens per chunk."""
        return self.seq_len // self.num_chunks

    @property
    def local_tokens(self) -> int:
        """Tokens this rank holds: seq_len / cp."""
        return self.seq_len // self.context_parallel


def sequence_length_problem(
    seq_len: int,
    context_parallel: int,
    *,
    subject: str = "a sequence has",
    fix: str = "make the dataset's sequence length (e.g. dataset.seq_len)",
) -> str | None:
    """Why context parallelism cannot cut sequences of `seq_len` tokens into 2·cp equal chunks, or None.

    The one statement of the rule, for every place a length comes from: `subject` says whose length
    it is (`"the dataset's sequences have"`, `"--seq-len gives"`), `fix` how to change it, ending
    where "a multiple of 2·cp" follows (`"set eval_dataset.seq_len to"`, `"pass"`).
    """
    chunks = 2 * context_parallel
    if context_parallel <= 1 or (seq_len > 0 and seq_len % chunks == 0):
        return None
    return (
        f"{subject} {seq_len} tokens, not divisible by 2 × mesh.context_parallel = {chunks} (context "
        f"parallelism cuts each sequence into {chunks} equal chunks); {fix} a multiple of {chunks} or "
        "change mesh.context_parallel"
    )


def check_sequence_length(seq_len: int, context_parallel: int, *, subject: str, fix: str) -> None:
    """Refuse a sequence length context parallelism cannot cut (`sequence_length_problem`'s message).

    Raises:
        SequenceLengthError: `seq_len` is not a positive multiple of 2·cp.
    """
    problem = sequence_length_problem(seq_len, context_parallel, subject=subject, fix=fix)
    if problem is not None:
        raise SequenceLengthError(problem)


class ContextParallel:
    """The context-parallel group of this rank: its layout of the sequence and the collectives over it.

    Build it with `ContextParallel.from_mesh(mesh)`. A size-1 group (or no mesh) is a disabled
    instance: every method is the identity and attention is plain causal attention, so model code
    calls the same methods with or without context parallelism.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        """Wrap `group` (the ranks that share one sequence); None means context parallelism is off."""
        self._group = group
        self._size = 1 if group is None else dist.get_world_size(group)
        self._rank = 0 if group is None else dist.get_rank(group)

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh | None, axis: str = "cp") -> "ContextParallel":
        """The cp group of `mesh`'s `axis` (a job's dense mesh or a 1-D ("cp",) mesh); None: disabled.

        Raises:
            ParallelizeError: if the mesh has no axis names or no `axis`.
        """
        if mesh is None:
            return cls(None)
        axis_names(mesh)  # refuses an unnamed mesh
        if axis_size(mesh, axis) == 1:
            return cls(None)
        return cls(mesh.get_group(axis))

    @property
    def size(self) -> int:
        """Number of ranks sharing one sequence (1 when disabled)."""
        return self._size

    @property
    def rank(self) -> int:
        """This rank's index in the cp group (0 when disabled)."""
        return self._rank

    @property
    def enabled(self) -> bool:
        """True when the sequence is split over more than one rank."""
        return self._size > 1

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group of the cp axis; None when disabled."""
        return self._group

    def __repr__(self) -> str:
        return f"ContextParallel(size={self._size}, rank={self._rank})"

    def __deepcopy__(self, memo: dict[int, Any]) -> "ContextParallel":
        """A copied module keeps the same group (a process group cannot be copied)."""
        return self

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
    ) -> torch.Tensor:
        """`context_parallel_attention(q, k, v, self, scale=scale)`: what a model's attention calls."""
        return context_parallel_attention(q, k, v, self, scale=scale)

    def shard_batch(self, batch: Any, dim: int = 1) -> Any:
        """This rank's part of a microbatch: every tensor with the batch's sequence length along `dim`
        is sharded (`shard_sequence`), anything else is kept whole.

        The sequence length is the `dim` size of `batch["input_ids"]` when the batch is a mapping
        that has it, else of the first tensor with more than `dim` dimensions. Mappings, lists and
        tuples are walked; an identity when disabled.

        Raises:
            SequenceLengthError: the sequence length is not divisible by 2·size (naming the fix).
        """
        if not self.enabled:
            return batch
        seq_len = _sequence_length(batch, dim)
        if seq_len is None:
            return batch
        self.check_seq_len(seq_len)

        def shard(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if value.dim() > dim and value.size(dim) == seq_len:
                    return self.shard_sequence(value, dim)
                return value
            if isinstance(value, Mapping):
                return type(value)({key: shard(item) for key, item in value.items()})  # type: ignore[call-arg]
            if isinstance(value, list | tuple):
                return type(value)(shard(item) for item in value)
            return value

        return shard(batch)

    def check_seq_len(self, seq_len: int) -> None:
        """Refuse a sequence length the load-balanced layout cannot split (a no-op when disabled).

        Raises:
            SequenceLengthError: if `seq_len` is not a positive multiple of 2·size.
        """
        if not self.enabled:
            return
        problem = sequence_length_problem(seq_len, self._size)
        if problem is not None:
            raise SequenceLengthError(problem)

    def position_ids(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of this rank's `seq_len // size` tokens (int64), e.g. for RoPE."""
        self.check_seq_len(seq_len)
        return _positions(seq_len, self._size, self._rank, device)

    def shard_sequence(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a full-length tensor along `dim` (ids, labels, masks; any dtype).

        Differentiable; returns a new tensor (the input itself when disabled).
        """
        if not self.enabled:
            return x
        self.check_seq_len(x.size(dim))
        chunks = x.chunk(2 * self._size, dim)
        return torch.cat([chunks[c] for c in _chunk_ids(self._size, self._rank)], dim)

    def unshard_sequence(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full sequence along `dim` in global order, from every rank's shard (all-gather).

        Every rank of the group must call it. Differentiable: the backward sums, over the cp ranks,
        the gradients that reach each rank's tokens and returns them to their owner (reduce-scatter),
        so a loss that each rank computes on the *whole* unsharded tensor counts `size` times.
        """
        if not self.enabled:
            return x
        self.check_seq_len(x.size(dim) * self._size)  # each rank's shard holds two equal chunks
        dim = dim % x.dim()
        gathered = all_gather_autograd(x.movedim(dim, 0).contiguous(), self._group)
        # Rank r's block is [chunk r, chunk 2·size−1−r]; put the 2·size chunks back in global order.
        chunks = gathered.movedim(0, dim).chunk(2 * self._size, dim)
        first = [chunks[2 * r] for r in range(self._size)]
        mirrored = [chunks[2 * r + 1] for r in reversed(range(self._size))]
        return torch.cat(first + mirrored, dim)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: ContextParallel | None,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact causal attention of this rank's queries against the whole sequence's keys.

    Tokens are in `cp`'s load-balanced layout, with RoPE (or any position encoding) already applied
    with global positions (`cp.position_ids`). Every rank of the cp group must call it. With `cp`
    disabled (or None) it is `F.scaled_dot_product_attention(q, k, v, is_causal=True)`.

    Args:
        q: [batch, q_heads, s_local, head_dim].
        k: [batch, kv_heads, s_local, head_dim]; kv_heads divides q_heads (MHA, GQA, MQA).
        v: like `k` (its last dim may differ from head_dim).
        cp: the cp group; None means no context parallelism.
        scale: softmax scale; None for 1/sqrt(head_dim).

    Returns:
        [batch, q_heads, s_local, v_head_dim], in the same layout as `q`.

    Raises:
        ParallelizeError: on shapes that do not fit (the message names them).
    """
    _check_shapes(q, k, v)
    gqa = q.size(1) != k.size(1)
    if cp is None or not cp.enabled:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    cp.check_seq_len(q.size(2) * cp.size)
    chunk = q.size(2) // 2
    k_full, v_full = _gather_keys_values(k, v, cp)
    outputs = []
    for half, c in enumerate(_chunk_ids(cp.size, cp.rank)):
        end = (c + 1) * chunk
        q_chunk = q.narrow(2, half * chunk, chunk)
        outputs.append(_causal_lower_right(q_chunk, k_full[:, :, :end], v_full[:, :, :end], scale, gqa))
    return torch.cat(outputs, 2)


def _gather_keys_values(
    k: torch.Tensor, v: torch.Tensor, cp: ContextParallel
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole sequence's K and V ([batch, kv_heads, seq_len, dim], global order) from every cp
    rank's share: one all-gather for both when their head dims agree; gradients return to the owners."""
    if k.size(-1) == v.size(-1):
        k_full, v_full = cp.unshard_sequence(torch.stack([k, v]), dim=3).unbind(0)
    else:
        k_full, v_full = cp.unshard_sequence(k, dim=2), cp.unshard_sequence(v, dim=2)
    recording = _GATHERED.get()
    if recording is not None:
        recording += [k_full, v_full]
    return k_full, v_full


def parallelize_context_parallel(module: nn.Module, mesh: DeviceMesh | None) -> ContextParallel:
    """Give every submodule of `module` that supports context parallelism the mesh's cp group.

    A module supports it by declaring an attribute `context_parallel` (None until set) and, when it
    is set, calling `self.context_parallel.attention(q, k, v)` for its causal attention and
    `self.context_parallel.position_ids(...)` for its positions. The trainer shards each microbatch
    (`ContextParallel.shard_batch`). With `mesh` None or cp 1 the modules are left as they are.

    Returns:
        The cp group (disabled when there is no context parallelism).

    Raises:
        ParallelizeError: cp > 1 but no submodule declares `context_parallel`.
    """
    cp = (
        ContextParallel.from_mesh(mesh)
        if mesh is not None and "cp" in axis_names(mesh)
        else ContextParallel()
    )
    if not cp.enabled:
        return cp
    supporting = [m for m in module.modules() if hasattr(m, "context_parallel")]
    if not supporting:
        raise ParallelizeError(
            f"parallelize_context_parallel: no module of {type(module).__name__} supports context parallelism "
            "(none declares a context_parallel attribute to call cp.attention with); add it to the model's "
            "attention or set mesh.context_parallel: 1"
        )
    for sub in supporting:
        sub.context_parallel = cp
    return cp


def context_parallel_of(module: nn.Module) -> ContextParallel | None:
    """The enabled cp group set on some submodule of `module` (by `parallelize_context_parallel`), or None."""
    for sub in module.modules():
        cp = getattr(sub, "context_parallel", None)
        if isinstance(cp, ContextParallel) and cp.enabled:
            return cp
    return None


def _sequence_length(batch: Any, dim: int) -> int | None:
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() > dim:
            return int(ids.size(dim))
        values: Any = list(batch.values())
    elif isinstance(batch, list | tuple):
        values = batch
    else:
        values = [batch]
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.dim() > dim:
                return int(value.size(dim))
        elif isinstance(value, Mapping | list | tuple):
            found = _sequence_length(value, dim)
            if found is not None:
                return found
    return None


def _chunk_ids(size: int, rank: int) -> tuple[int, int]:
    """The two global chunks (of 2·size) that `rank` holds, in the order it holds them."""
    return rank, 2 * size - 1 - rank


def _positions(seq_len: int, size: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of `rank`'s tokens under the load-balanced layout (pure arithmetic)."""
    if size == 1:
        return torch.arange(seq_len, device=device)
    share = SequenceShare(seq_len, size, rank)
    chunk = share.chunk_tokens
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in share.chunks])


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if not (q.dim() == k.dim() == v.dim() == 4):
        raise ParallelizeError(
            "context_parallel_attention takes q, k, v as [batch, heads, seq, head_dim]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if (
        k.shape[:3] != v.shape[:3]
        or q.size(0) != k.size(0)
        or q.size(2) != k.size(2)
        or q.size(3) != k.size(3)
    ):
        raise ParallelizeError(
            "context_parallel_attention needs q, k, v with the same batch and local sequence length, "
            f"and q, k with the same head_dim; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.size(1) % k.size(1) != 0:
        raise ParallelizeError(
            f"context_parallel_attention: kv_heads {k.size(1)} must divide q_heads {q.size(1)}"
        )


def _causal_lower_right(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, gqa: bool
) -> torch.Tensor:
    """Causal attention where the last query sits at the last key (the queries are the keys' tail)."""
    q_len, kv_len = q.size(-2), k.size(-2)
    if q_len == kv_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if q.device.type == "cuda" and (not gqa or _can_use_flash(q, k, v)):
        # CausalBias runs the flash or memory-efficient kernel without materializing a mask. Its
        # efficient branch passes K/V to the kernel as they are, so GQA goes there only with flash.
        bias = causal_lower_right(q_len, kv_len)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=gqa)
    if q.device.type == "cpu" or (q.device.type == "meta" and _META_AS.get() == "cpu"):
        # CPU: SDPA would save an explicit mask for backward as float32 [q_len, kv_len] (640 MiB per rank
        # at 16k tokens, cp 2). Pad the queries in front to a square and use the causal kernel instead:
        # the real queries sit at the end, exactly where lower-right alignment puts them, and the padded
        # rows' outputs are dropped (their gradients are zero). Saved: q and output at kv_len rows.
        pad = q.new_zeros((*q.shape[:2], kv_len - q_len, q.size(-1)))
        out = F.scaled_dot_product_attention(
            torch.cat([pad, q], 2), k, v, is_causal=True, scale=scale, enable_gqa=gqa
        )
        return out[:, :, kv_len - q_len :]
    # CUDA GQA without flash (or the meta device, e.g. `d9d plan`'s estimate): an explicit boolean mask.
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)


def _can_use_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, True)
    return bool(torch.backends.cuda.can_use_flash_attention(params, False))
