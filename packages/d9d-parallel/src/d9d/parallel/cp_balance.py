"""The attention work of each context-parallel rank over packed rows, and a reordering that evens it.

Under context parallelism a row of `seq` tokens is cut into 2·cp chunks and rank r holds chunks r and
2·cp−1−r (`d9d.parallel.context_parallel`). With one causal document per row that gives every rank
the same number of attended (query, key) pairs. With packed documents (`DocumentMask`: a query sees
only earlier keys of its own document, within the window if any) it does not: a query's work is its
place in its document, not in the row, so one long document at the row's end loads the rank holding
the last chunk. The attention of every layer waits for the slowest rank of the cp group.

`attention_pairs_per_rank` counts the exact pairs each rank computes, from the document ids alone:
token p attends to the tokens of its document at or before p (at most `window` of them), so its count
is its place in its document: O(seq) per row when every document is one run of tokens (packing), one
sort of (document, position) when an id comes back later in its row; never a [seq, seq] mask.
`balance_ratio` is the most loaded rank over the mean.

`balanced_document_order` is the remedy: a permutation of each row that moves whole documents (their
tokens keep their order, position ids and document ids travel with them) so the pair counts even out.
The loss is a sum over tokens and each document's attention sees only its own tokens, so a row and
its permutation give the same numbers. Measured in benchmarks/cp_balance.py (benchmarks/README.md).
"""

import bisect
import itertools

import torch

__all__ = [
    "attention_pairs_per_rank",
    "balance_ratio",
    "balanced_document_order",
    "token_attention_pairs",
]


def token_attention_pairs(document_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The keys each token attends to: int64 [batch, seq], its own and its document's earlier tokens,
    at most `window` of them (positions p − window < k <= p).

    Args:
        document_ids: int [batch, seq] (any ids; a repeated id is one document, as `DocumentMask` reads it).
        window: the sliding window in tokens; None for none.
    """
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [batch, seq], got shape {tuple(document_ids.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must be at least 1 token, got {window}")
    batch, seq = document_ids.shape
    ids = document_ids.detach().to("cpu", torch.int64)
    positions = torch.arange(seq).expand(batch, seq)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    run_ids = torch.stack([torch.arange(batch)[:, None].expand(batch, seq)[starts], ids[starts]])
    if torch.unique(run_ids, dim=1).size(1) == run_ids.size(1):  # each document one run: O(seq)
        first = torch.where(starts, positions, 0).cummax(1).values
        pairs = positions - first + 1
        return pairs.clamp(max=window) if window is not None else pairs
    return _pairs_by_sort(ids, positions, window)


def _pairs_by_sort(ids: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """`token_attention_pairs` where a document id comes back after another: one sort of (document,
    position), O(seq log seq)."""
    batch, seq = ids.shape
    _, group = torch.unique(ids, return_inverse=True)  # dense document numbers
    groups = int(group.max()) + 1 if group.numel() else 1
    group = group + torch.arange(batch)[:, None] * groups  # documents of different rows differ
    stride = seq + 1
    keys = (group * stride + positions).flatten()  # (document, position), already unique
    ordered = keys.sort().values
    # tokens of its document at or before p, minus those at or before p - window
    upto = torch.searchsorted(ordered, keys, right=True)
    if window is None:
        first = torch.searchsorted(ordered, group.flatten() * stride, right=False)
        return (upto - first).view(batch, seq)
    before = (positions - window).clamp(min=-1)  # -1: the end of the previous document's range
    below = torch.searchsorted(ordered, (group * stride + before).flatten(), right=True)
    return (upto - below).view(batch, seq)


def attention_pairs_per_rank(
    document_ids: torch.Tensor, context_parallel: int, window: int | None = None
) -> torch.Tensor:
    """The attended (query, key) pairs of each cp rank for a batch of whole rows: int64 [cp].

    Rank r computes the queries of chunks r and 2·cp−1−r of every row (the load-balanced layout); the
    pairs are exact (`token_attention_pairs`). `context_parallel` 1: the whole batch's pairs, [1].

    Raises:
        ValueError: a sequence length not divisible by 2·cp, or a cp below 1.
    """
    if context_parallel < 1:
        raise ValueError(f"context_parallel must be at least 1, got {context_parallel}")
    pairs = token_attention_pairs(document_ids, window)
    if context_parallel == 1:
        return pairs.sum().reshape(1)
    chunks, seq = 2 * context_parallel, document_ids.size(1)
    if seq % chunks:
        raise ValueError(
            f"a row of {seq} tokens cannot be cut into 2 × cp = {chunks} equal chunks; use a sequence "
            f"length that is a multiple of {chunks}"
        )
    per_chunk = pairs.view(pairs.size(0), chunks, seq // chunks).sum((0, 2))
    return per_chunk[:context_parallel] + per_chunk.flip(0)[:context_parallel]


def balance_ratio(pairs_per_rank: torch.Tensor) -> float:
    """The most loaded rank's work over the mean (1.0: even; 1.0 when there is no work)."""
    total = float(pairs_per_rank.sum())
    if total == 0:
        return 1.0
    return float(pairs_per_rank.max()) * pairs_per_rank.numel() / total


def balanced_document_order(
    document_ids: torch.Tensor, context_parallel: int, window: int | None = None, *, moves: int = 4
) -> torch.Tensor:
    """A gather index [batch, seq] that reorders whole documents within each row so the cp ranks'
    attention pairs over the batch even out (`row[index]`; apply it to every per-token tensor alike).

    A document's tokens keep their order. Rows are taken one after another, each arranged to lower the
    most loaded rank's pairs of the rows so far (the batch is one attention call: its slowest rank is
    what the others wait for). The candidates for a row: as it is, its documents longest first and
    shortest first, then each of its `moves` longest documents moved to its best slot; each is scored
    exactly in O(documents + cp) from the document lengths. A row stays as it is unless a candidate is
    strictly better; a row whose id appears in two runs (one document split) is left alone.
    """
    if context_parallel < 1:
        raise ValueError(f"context_parallel must be at least 1, got {context_parallel}")
    batch, seq = document_ids.shape
    index = torch.arange(seq).repeat(batch, 1)
    if context_parallel == 1:
        return index
    if seq % (2 * context_parallel):
        attention_pairs_per_rank(document_ids[:0], context_parallel)  # raises, naming the fix
    ids = document_ids.detach().to("cpu", torch.int64)
    loads = [0] * context_parallel  # the rows so far, per rank
    for row in range(batch):
        lengths = torch.unique_consecutive(ids[row], return_counts=True)[1].tolist()
        layout = _RowLayout(seq, context_parallel, window)
        contiguous = len(lengths) == torch.unique(ids[row]).numel()
        order = _best_order(lengths, layout, loads, moves) if contiguous and len(lengths) > 1 else None
        if order is not None:
            starts = [0, *itertools.accumulate(lengths)]
            index[row] = torch.cat([torch.arange(starts[d], starts[d + 1]) for d in order])
        kept = order if order is not None else list(range(len(lengths)))
        loads = [a + b for a, b in zip(loads, layout.rank_pairs([lengths[d] for d in kept]), strict=True)]
    return index


class _RowLayout:
    """Scores an arrangement of whole documents in one row: pairs per cp rank, from the lengths alone."""

    def __init__(self, seq: int, cp: int, window: int | None) -> None:
        self.cp, self.window = cp, window
        chunk = seq // (2 * cp)
        self.bounds = [c * chunk for c in range(2 * cp + 1)]

    def _pairs(self, tokens: int) -> int:
        """Pairs of the first `tokens` tokens of one document: sum of min(i, window), i = 1..tokens."""
        w = self.window
        if w is None or tokens <= w:
            return tokens * (tokens + 1) // 2
        return w * (w + 1) // 2 + (tokens - w) * w

    def rank_pairs(self, lengths: list[int]) -> list[int]:
        """Each rank's pairs when the row holds documents of `lengths` in that order."""
        starts = [0, *itertools.accumulate(lengths)]
        before = [0, *itertools.accumulate(self._pairs(n) for n in lengths)]  # pairs of whole documents
        upto = []  # pairs of the tokens before each chunk boundary
        for b in self.bounds:
            d = min(bisect.bisect_right(starts, b) - 1, len(lengths) - 1)
            upto.append(before[d] + self._pairs(b - starts[d]))
        chunk = [upto[c + 1] - upto[c] for c in range(len(upto) - 1)]
        return [chunk[r] + chunk[-1 - r] for r in range(self.cp)]


def _best_order(lengths: list[int], layout: _RowLayout, loads: list[int], moves: int) -> list[int] | None:
    """The best order found for a row's documents given the rows before it (`balanced_document_order`);
    None: keep the row."""

    def score(order: list[int]) -> int:
        pairs = layout.rank_pairs([lengths[d] for d in order])
        return max(a + b for a, b in zip(loads, pairs, strict=True))

    original = list(range(len(lengths)))
    longest = sorted(original, key=lambda d: -lengths[d])
    best, best_score = original, score(original)
    for candidate in (longest, longest[::-1]):
        if (value := score(candidate)) < best_score:
            best, best_score = candidate, value
    for doc in longest[:moves]:
        rest = [d for d in best if d != doc]
        for slot in range(len(lengths)):
            candidate = [*rest[:slot], doc, *rest[slot:]]
            if (value := score(candidate)) < best_score:
                best, best_score = candidate, value
    return None if best == original else best
