"""Several documents in one fixed-length row: which rows hold which documents, and the block-causal mask.

A packed row carries `position_ids` (restarting at 0 in every document) and `document_ids` (0, 1, ...
per document, -1 for padding). A model that should not attend across documents must use them: pass
`position_ids` to its rotary/positional embedding and `block_causal_mask(document_ids)` as the
attention mask (or turn `document_ids` into sequence lengths for a varlen kernel). A model that
ignores them attends across document boundaries as in plain causal packing.
"""

import bisect
from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "PADDING_DOCUMENT_ID",
    "block_causal_mask",
    "document_positions",
    "eos_document_ids",
    "pack_lengths",
]

#: `document_ids` value of the padding at the end of a packed row (padding only attends to padding).
PADDING_DOCUMENT_ID = -1


def pack_lengths(lengths: Sequence[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """Group items of the given lengths into rows of at most `capacity` (best-fit decreasing).

    Deterministic: the longest items are placed first, each into the fullest row it still fits. Returns
    each row's item indices in the order they were placed; every index appears exactly once.

    Raises:
        ValueError: an item is longer than `capacity` or not positive.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.max() > capacity or lengths.min() < 1):
        raise ValueError(f"every length must be in [1, {capacity}], got {lengths.min()}..{lengths.max()}")
    order = np.argsort(-lengths, kind="stable")
    rows: list[list[int]] = []
    # (space left, row index) of the rows that still have room, sorted: bisect finds the best fit.
    free: list[tuple[int, int]] = []
    for item in order.tolist():
        length = int(lengths[item])
        at = bisect.bisect_left(free, (length, -1))
        if at == len(free):
            rows.append([item])
            space, row = capacity - length, len(rows) - 1
        else:
            space, row = free.pop(at)
            rows[row].append(item)
            space -= length
        if space > 0:
            bisect.insort(free, (space, row))
    return rows


def document_positions(document_ids: np.ndarray) -> np.ndarray:
    """Position of every token inside its document (0 at each document start), for one row of ids.

    A document is a run of equal consecutive ids, so padding (-1) counts as a document of its own.
    """
    ids = np.asarray(document_ids)
    n = len(ids)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    new = np.concatenate([[True], ids[1:] != ids[:-1]])
    starts = np.flatnonzero(new)
    return np.arange(n, dtype=np.int64) - starts[np.cumsum(new) - 1]


def eos_document_ids(input_ids: np.ndarray, eos_id: int) -> np.ndarray:
    """Document index of every token of a window of EOS-separated text: an EOS ends its document."""
    is_eos = np.asarray(input_ids) == eos_id
    ids = np.zeros(len(is_eos), dtype=np.int64)
    ids[1:] = np.cumsum(is_eos[:-1])
    return ids


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Attention mask of packed rows: token q may attend to token k iff k <= q and both share a document.

    Args:
        document_ids: int tensor [batch, seq] (or [seq]) as yielded by packed datasets.

    Returns:
        bool tensor [batch, 1, seq, seq], True where attention is allowed: usable as the `attn_mask`
        of `torch.nn.functional.scaled_dot_product_attention` (broadcast over heads). Every row allows
        at least the diagonal, so no query is fully masked.
    """
    if document_ids.dim() == 1:
        document_ids = document_ids.unsqueeze(0)
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [batch, seq] or [seq], got shape {tuple(document_ids.shape)}")
    seq = document_ids.shape[-1]
    same = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal).unsqueeze(1)
