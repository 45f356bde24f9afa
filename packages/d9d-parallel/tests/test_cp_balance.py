"""The attention work per context-parallel rank over packed rows (`d9d.parallel.cp_balance`): the pair
counts against the mask written out from its definition, and the document reordering (a permutation of
whole documents that evens the ranks' pairs out without changing any document)."""

import pytest
import torch

from d9d.parallel import (
    SequenceShare,
    attention_pairs_per_rank,
    balance_ratio,
    balanced_document_order,
    token_attention_pairs,
)
from d9d.parallel.cp_balance import _RowLayout


def _mask(ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """[batch, seq, seq]: query i may attend to key j (same id, j <= i, i - j < window)."""
    i = torch.arange(ids.size(1))[:, None]
    j = torch.arange(ids.size(1))[None, :]
    allowed = (ids[:, :, None] == ids[:, None, :]) & (j <= i)
    return allowed & (i - j < window) if window is not None else allowed


def _rows(seq: int, seed: int) -> torch.Tensor:
    """Four packed rows of random document lengths (one long document in row 0), padding (-1) ending
    row 1, an id split in two runs in row 2, and one document over the whole row 3."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for r in range(4):
        lengths = torch.randint(1, seq // 3, (seq,), generator=gen)
        if r == 0:
            lengths[0] = seq // 2
        row = torch.repeat_interleave(torch.arange(seq), lengths)[:seq]
        rows.append(row if r < 3 else torch.zeros(seq, dtype=torch.long))
    rows[1][-3:] = -1
    rows[2][-2:] = rows[2][0]
    return torch.stack(rows)


@pytest.mark.parametrize("window", [None, 1, 5, 1000])
@pytest.mark.parametrize("rows", [[0, 1, 3], [0, 1, 2, 3]], ids=["one-run-documents", "a-split-document"])
def test_token_pairs_are_the_mask_row_sums(window: int | None, rows: list[int]) -> None:
    ids = _rows(48, seed=1)[rows]
    assert torch.equal(token_attention_pairs(ids, window), _mask(ids, window).sum(-1))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("window", [None, 6])
def test_rank_pairs_follow_the_load_balanced_layout(cp: int, window: int | None) -> None:
    seq = 2 * cp * 6
    ids = _rows(seq, seed=cp)
    counts = _mask(ids, window).sum(-1)
    want = []
    for rank in range(cp):
        share = SequenceShare(seq, cp, rank)
        chunk = share.chunk_tokens
        want.append(sum(int(counts[:, c * chunk : (c + 1) * chunk].sum()) for c in share.chunks))
    assert attention_pairs_per_rank(ids, cp, window).tolist() == want


def test_one_document_per_row_is_even_and_a_late_long_document_is_not() -> None:
    whole = torch.zeros(2, 64, dtype=torch.long)
    assert balance_ratio(attention_pairs_per_rank(whole, 4)) == 1.0
    late = (torch.arange(64) >= 16).long()[None]  # short documents' tokens first, one long one last
    late[0, :16] = torch.arange(2, 18)
    pairs = attention_pairs_per_rank(late, 4)
    assert balance_ratio(pairs) == pytest.approx(float(pairs.max()) / float(pairs.float().mean()))
    assert pairs.tolist()[0] == 8 + 8 * 40 + 36  # rank 0: chunk 0 (one-token documents) and the last
    assert balance_ratio(pairs) > 1.2


def test_a_sequence_length_the_layout_cannot_cut_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        attention_pairs_per_rank(torch.zeros(1, 12, dtype=torch.long), 4)


@pytest.mark.parametrize("window", [None, 7])
def test_the_row_scorer_counts_what_the_mask_counts(window: int | None) -> None:
    gen = torch.Generator().manual_seed(3)
    for cp in (2, 4):
        seq = 2 * cp * 8
        lengths = torch.randint(1, seq // 2, (seq,), generator=gen)
        ids = torch.repeat_interleave(torch.arange(seq), lengths)[:seq][None]
        runs = torch.unique_consecutive(ids[0], return_counts=True)[1].tolist()
        got = _RowLayout(seq, cp, window).rank_pairs(runs)
        assert got == attention_pairs_per_rank(ids, cp, window).tolist()


def _skewed(rows: int, seq: int, seed: int) -> torch.Tensor:
    """Rows of short documents then one long one (a quarter of the row) at the end."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        short = torch.randint(8, 64, (seq,), generator=gen)
        lengths = torch.cat([short[: int((short.cumsum(0) < seq * 3 // 4).sum())], torch.tensor([seq // 4])])
        lengths[-2] += seq - int(lengths.sum())
        out.append(torch.repeat_interleave(torch.arange(lengths.numel()), lengths))
    return torch.stack(out)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_reordering_moves_whole_documents_and_evens_the_batch(cp: int) -> None:
    ids = _skewed(8, 1024, seed=cp)
    index = balanced_document_order(ids, cp)
    moved = torch.gather(ids, 1, index)
    for row in range(ids.size(0)):
        assert sorted(index[row].tolist()) == list(range(ids.size(1)))  # a permutation
        for doc in ids[row].unique():
            where = index[row][moved[row] == doc]  # the document's tokens, where they came from
            assert torch.equal(where, torch.arange(int(where[0]), int(where[0]) + where.numel()))
    before = balance_ratio(attention_pairs_per_rank(ids, cp))
    after = balance_ratio(attention_pairs_per_rank(moved, cp))
    assert before > 1.15 and after <= 1.15, (before, after)


def test_an_even_row_and_a_split_document_stay_as_they_are() -> None:
    whole = torch.zeros(1, 32, dtype=torch.long)
    assert torch.equal(balanced_document_order(whole, 2), torch.arange(32)[None])
    split = torch.cat([torch.zeros(4), torch.ones(24), torch.zeros(4)]).long()[None]
    assert torch.equal(balanced_document_order(split, 2), torch.arange(32)[None])
