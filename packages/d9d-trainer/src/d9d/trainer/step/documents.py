"""Packed rows under context parallelism: the step's attention balance over the cp ranks, and the
optional reordering of whole documents that evens it (`trainer.attention.balance_documents`).

Both run on the host from the microbatch's `document_ids` before the batch is sharded and moved to the
device (the data provider's tensors are on the CPU): no device read, nothing in the hot path. The
pairs are `d9d.parallel.attention_pairs_per_rank` without a window (a windowed model computes fewer).
Reordering moves every per-token tensor of the batch (ids, labels, positions, document ids) with the
same index, so each document keeps its tokens, positions and labels, in order, and the summed loss is
the same sum (to rounding). It needs the batch's `position_ids` (else the model would number the moved
tokens by their new place), so a batch without them is left as it is.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from d9d.parallel import attention_pairs_per_rank, balanced_document_order

__all__ = ["attention_balance", "reorder_documents"]


def reorder_documents(batch: Any, context_parallel: int) -> Any:
    """`batch` with its rows' documents reordered to even the cp ranks' pairs (a new mapping); the batch
    itself when it is not a packed mapping with `document_ids` and `position_ids`, or cp is 1."""
    if context_parallel <= 1 or not isinstance(batch, Mapping):
        return batch
    ids = batch.get("document_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or "position_ids" not in batch:
        return batch
    index = balanced_document_order(ids, context_parallel)
    rows = torch.arange(ids.size(0))[:, None]

    def moved(value: Any) -> Any:
        per_token = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == ids.shape
        return value[rows, index.to(value.device)] if per_token else value

    return {key: moved(value) for key, value in batch.items()}


def attention_balance(microbatches: Sequence[Any], context_parallel: int) -> float | None:
    """The step's attention work on its most loaded cp rank over the mean: Σ max / Σ mean over the
    microbatches (each is one attention call per layer, which waits for its slowest rank); None when
    cp is 1 or no microbatch carries `document_ids`."""
    if context_parallel <= 1:
        return None
    slowest = mean = 0.0
    for batch in microbatches:
        ids = batch.get("document_ids") if isinstance(batch, Mapping) else None
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:
            pairs = attention_pairs_per_rank(ids, context_parallel)
            slowest += float(pairs.max())
            mean += float(pairs.sum()) / context_parallel
    return slowest / mean if mean > 0 else None
