"""Attention over packed documents: causal within a document, nothing across documents, optionally
within a sliding window; on one process or over context-parallel ranks.

Packed rows (several samples in one row of `seq` tokens, `d9d.data.SFTDataset(pack=True)` or
`document_masking`) carry `document_ids` [batch, seq]. Token q may attend to token k iff k <= q, both
belong to one document and, with a window `w` (Mistral, Qwen2, Gemma 2/3 local layers), q − k < w.
`DocumentMask` is built once per batch from the ids and shared by every layer; its
`attention(q, k, v)` runs one of two kernels with the same result:

- `"flex"`: FlexAttention (`torch.nn.attention.flex_attention`) with a block mask. Only the blocks
  that hold attended pairs are computed. On CUDA both the attention and the block mask's
  construction are compiled, so the mask is built block by block, never as a [seq, seq] tensor
  (eager construction, used elsewhere, materializes it). torch has no FlexAttention backward on
  CPU; the CUDA path (forward and backward) has not been run in d9d's tests, which have no GPU.
- `"sdpa"`: `scaled_dot_product_attention` with a dense boolean mask. It runs everywhere and trains
  on CPU, but the mask costs a byte per (query, key) pair and a masked SDPA cannot use flash.

`"auto"` picks FlexAttention on CUDA and SDPA elsewhere. Soft-capped scores (Gemma 2's
`attn_logit_softcapping`) are FlexAttention's score modification, and on the "sdpa" path the scores
written out (SDPA has no cap), under the same mask.

Context parallelism (`context_parallel=` an enabled `ContextParallel`): `document_ids` is this rank's
share in the load-balanced layout (`ContextParallel.shard_batch` shards it with the batch). The
constructor all-gathers the ids once (the keys' documents, global order; the same in every layer),
and `attention` all-gathers K and V (`context_parallel_attention`'s one collective). A query at global
position p of its chunk then attends to the gathered keys k with k <= p, of its document and within
the window. "sdpa" runs each of the rank's two query chunks against the key prefix it can see (from
the window's start, when there is one, to the chunk's end) under a boolean [chunk, prefix] mask;
"flex" runs both chunks at once under one block mask of [seq / cp, seq] (queries mapped to their
global positions inside the mask function), so its memory stays O(blocks).
"""

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
import torch.nn.functional as F

from d9d.parallel.context_parallel import ContextParallel, _chunk_ids, _gather_keys_values

__all__ = ["DocumentAttentionBackend", "DocumentMask", "document_attention_backend"]

DocumentAttentionBackend = Literal["auto", "flex", "sdpa"]

#: What `_compiled_on_cuda` compiled in this process, by the function compiled.
_compiled: dict[Callable[..., Any], Callable[..., Any]] = {}
#: FlexAttention's soft-cap score modification, by cap (`_score_mod`).
_score_mods: dict[float, Callable[..., Any]] = {}


def document_attention_backend(device: torch.device, backend: DocumentAttentionBackend = "auto") -> str:
    """The kernel `DocumentMask` uses on `device`: "flex" or "sdpa" ("auto": flex on CUDA only).

    Raises:
        ValueError: an unknown backend name.
    """
    if backend not in ("auto", "flex", "sdpa"):
        raise ValueError(f"document attention backend must be 'auto', 'flex' or 'sdpa', got {backend!r}")
    if backend != "auto":
        return backend
    return "flex" if device.type == "cuda" else "sdpa"


class DocumentMask:
    """The block-causal (optionally windowed) mask of one batch of packed rows, and attention under it.

    Args:
        document_ids: int [batch, seq], the document of each token (any ids; padding may have its
            own id, e.g. d9d.data's -1: it then attends only to padding before it). Under context
            parallelism: this rank's share of the row, in the load-balanced layout.
        backend: "auto", "flex" or "sdpa" (see the module docstring).
        context_parallel: the cp group the row is split over; None (or disabled): one process.
        windows: the sliding windows the layers ask for (None: no window); their masks are built
            here, once per batch (another window asked of `attention` is built at its first call).
    """

    def __init__(
        self,
        document_ids: torch.Tensor,
        *,
        backend: DocumentAttentionBackend = "auto",
        context_parallel: ContextParallel | None = None,
        windows: Iterable[int | None] = (None,),
    ) -> None:
        if document_ids.dim() != 2:
            raise ValueError(f"document_ids must be [batch, seq], got shape {tuple(document_ids.shape)}")
        self.document_ids = document_ids
        self.backend = document_attention_backend(document_ids.device, backend)
        cp = context_parallel if context_parallel is not None and context_parallel.enabled else None
        self.context_parallel = cp
        seq = document_ids.size(1) * (cp.size if cp is not None else 1)
        # The keys' documents in global order (one all-gather per batch) and the queries' global positions.
        self._key_ids = cp.unshard_sequence(document_ids, dim=1) if cp is not None else document_ids
        self._query_positions = (
            cp.position_ids(seq, document_ids.device)
            if cp is not None
            else torch.arange(seq, device=document_ids.device)
        )
        self._masks: dict[int | None, Any] = {}
        for window in windows:
            self._mask(window)

    def dense(self, window: int | None = None) -> torch.Tensor:
        """Bool [batch, 1, seq, seq] over the whole row: True where token q (dim 2) may attend to token
        k (dim 3)."""
        seq = self._key_ids.size(1)
        return _allowed(self._key_ids, torch.arange(seq, device=self._key_ids.device), 0, seq, window)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of q [batch, heads, seq, dim] over k, v [batch, kv_heads, seq, dim] (GQA when
        kv_heads divides heads) under the mask and `window`; [batch, heads, seq, dim]. `softcap`:
        scores capped to softcap·tanh(score / softcap) before the softmax (Gemma 2). Under context
        parallelism `seq` is this rank's share; every rank of the group must call it."""
        gqa = q.shape[1] != k.shape[1]
        mask = self._mask(window)
        cp = self.context_parallel
        if cp is not None:
            k, v = _gather_keys_values(k, v, cp)
        if self.backend == "flex":
            return _flex(q.device)(
                q, k, v, score_mod=_score_mod(softcap), block_mask=mask, scale=scale, enable_gqa=gqa
            )
        if cp is None:
            return _masked_attention(q, k, v, mask, scale, softcap)
        chunk = q.size(2) // 2
        outputs = []
        for half, (start, end, allowed) in enumerate(mask):
            q_chunk = q.narrow(2, half * chunk, chunk)
            outputs.append(
                _masked_attention(q_chunk, k[:, :, start:end], v[:, :, start:end], allowed, scale, softcap)
            )
        return torch.cat(outputs, 2)

    def _mask(self, window: int | None) -> Any:
        """The mask of `window` for this batch's kernel, built at its first use."""
        if window is not None and window < 1:
            raise ValueError(f"a sliding window must be at least 1 token, got {window}")
        if window not in self._masks:
            self._masks[window] = self._build(window)
        return self._masks[window]

    def _build(self, window: int | None) -> Any:
        ids, positions, cp = self._key_ids, self._query_positions, self.context_parallel
        if self.backend == "flex":
            return _mask_builder(ids.device)(ids, positions, window)
        if cp is None:
            return _allowed(ids, positions, 0, ids.size(1), window)
        # Per query chunk: the keys it can see, [start, end), and its mask over them.
        chunk = self.document_ids.size(1) // 2
        masks = []
        for c in _chunk_ids(cp.size, cp.rank):
            end = (c + 1) * chunk
            start = 0 if window is None else max(0, c * chunk - window + 1)
            queries = torch.arange(c * chunk, end, device=ids.device)
            masks.append((start, end, _allowed(ids, queries, start, end, window)))
        return masks


def _masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """SDPA under the boolean mask `allowed`; with `softcap`, which SDPA has no argument for, the scores
    written out (softmax in at least float32, as transformers' eager attention computes them)."""
    gqa = q.size(1) != k.size(1)
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    if gqa:
        k = k.repeat_interleave(q.size(1) // k.size(1), 1)
        v = v.repeat_interleave(q.size(1) // v.size(1), 1)
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.size(-1) ** -0.5)
    scores = (softcap * torch.tanh(scores / softcap)).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype) @ v


def _score_mod(softcap: float | None) -> Callable[..., Any] | None:
    """FlexAttention's score modification for `softcap` (one function per value, so a compiled
    FlexAttention sees the same one in every layer); None without a cap."""
    if softcap is None:
        return None
    if softcap not in _score_mods:

        def soft_cap(score: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
            return softcap * torch.tanh(score / softcap)

        _score_mods[softcap] = soft_cap
    return _score_mods[softcap]


def _allowed(
    key_ids: torch.Tensor, query_positions: torch.Tensor, start: int, end: int, window: int | None
) -> torch.Tensor:
    """Bool [batch, 1, queries, end − start]: the queries at global `query_positions` against keys
    [start, end) of `key_ids` [batch, seq]: same document, not later, within `window`."""
    keys = torch.arange(start, end, device=key_ids.device)
    query_ids = key_ids[:, query_positions]
    allowed = (query_ids[:, :, None] == key_ids[:, None, start:end]) & (
        keys[None, :] <= query_positions[:, None]
    )
    if window is not None:
        allowed &= query_positions[:, None] - keys[None, :] < window
    return allowed.unsqueeze(1)


def _build_block_mask(key_ids: torch.Tensor, query_positions: torch.Tensor, window: int | None) -> Any:
    """FlexAttention's block mask of queries at global `query_positions` over the keys of `key_ids`
    [batch, seq]: same document, not later, within `window`.

    The mask function is made here, inside what `_mask_builder` compiles, so the compiled graph
    takes the ids and positions as its inputs: a batch with other documents (same shape) reuses it.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    batch, seq = key_ids.shape

    def same_document_causal(b: Any, h: Any, q: Any, k: Any) -> Any:
        position = query_positions[q]
        allowed = (key_ids[b, position] == key_ids[b, k]) & (position >= k)
        if window is not None:
            allowed = allowed & (position - k < window)
        return allowed

    queries = query_positions.size(0)
    return create_block_mask(same_document_causal, batch, None, queries, seq, device=key_ids.device)


def _mask_builder(device: torch.device) -> Callable[..., Any]:
    """`_build_block_mask`, compiled once per process on CUDA, eager elsewhere.

    Compiled, the mask is built block by block and never as a [seq, seq] tensor. `dynamic=None`:
    one graph per process for one sequence length; a second length (an eval set's) recompiles once
    with the length dynamic, and later lengths reuse that graph.
    """
    return _compiled_on_cuda(_build_block_mask, device, dynamic=None)


def _flex(device: torch.device) -> Callable[..., Any]:
    """FlexAttention: compiled once on CUDA (the fused kernel), eager elsewhere (forward only on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    return _compiled_on_cuda(flex_attention, device, dynamic=False)


def _compiled_on_cuda(
    fn: Callable[..., Any], device: torch.device, *, dynamic: bool | None
) -> Callable[..., Any]:
    """`fn` compiled on the first call for a CUDA device (the same one afterwards); `fn` elsewhere."""
    if device.type != "cuda":
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=dynamic)
    return _compiled[fn]
