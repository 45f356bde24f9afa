"""Context-parallel attention over packed rows (`DocumentMask(..., context_parallel=cp)`), with and
without a sliding window: on cp 2 and cp 4 forked ranks, each rank's output and q/k/v gradients equal
one-process attention on the whole row, with documents that cross chunk boundaries, start exactly at
one, are one token long, span the whole row, and padding; with Gemma 2's soft-capped scores too.

Measured (torch 2.15, CPU): fp64 <= 1.1e-15, fp32 <= 9.1e-7 (relative to each tensor's scale),
FlexAttention's forward <= 3.6e-7."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from d9d.mesh.testing import run_distributed
from d9d.parallel import ContextParallel, DocumentMask

#: Windows the cases run: none, one token (a query sees itself), shorter than a chunk, longer than
#: one (it reaches into an earlier chunk), and the whole row (the same as none).
WINDOWS = (None, 1, 3, 7, 10_000)
CHUNK = 4  # tokens per chunk: each row is 2·cp chunks
#: (window, soft cap) of each case: every window, and Gemma 2's capped scores with and without one.
CASES = [*((w, None) for w in WINDOWS), (None, 0.5), (3, 0.5)]


def _rows(seq: int) -> torch.Tensor:
    """Document ids [2, seq]: row 0 has a one-token document, one crossing the first chunk boundary,
    one starting exactly at the boundary of chunks 2 and 3 and running over several chunks, then two
    tokens of padding (-1); row 1 is one document over the whole row."""
    cuts = torch.tensor([1, CHUNK + 1, 3 * CHUNK, seq - 2])
    row = (torch.arange(seq)[:, None] >= cuts[None, :]).sum(1)
    row[seq - 2 :] = -1
    return torch.stack([row, torch.full((seq,), 7)])


def _reference(
    q, k, v, ids: torch.Tensor, window: int | None, scale: float | None, softcap: float | None = None
):
    """One process, the whole row: SDPA under a mask written out here from its definition; with a
    soft cap, the capped scores' softmax written out."""
    seq = ids.size(1)
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    allowed = (ids[:, :, None] == ids[:, None, :]) & (j <= i)
    if window is not None:
        allowed = allowed & (i - j < window)
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed[:, None], scale=scale, enable_gqa=q.size(1) != k.size(1)
        )
    groups = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * (scale or q.size(-1) ** -0.5)
    scores = torch.where(allowed[:, None], softcap * torch.tanh(scores / softcap), float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |difference| relative to the tensor's scale (gradients reach |5|; fp32 rounds at 6e-8)."""
    return float((got.detach() - want.detach()).abs().max()) / max(1.0, float(want.abs().max()))


def _errors(cp: ContextParallel, heads: int, kv_heads: int, dtype: torch.dtype) -> dict[str, float]:
    """Per (window, soft cap): the largest relative difference of this rank's output and q/k/v gradients from one process."""
    seq = 2 * cp.size * CHUNK
    ids = _rows(seq)
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q, k, v, grad = (
        torch.randn(2, h, seq, 8, generator=gen, dtype=dtype) for h in (heads, kv_heads, kv_heads, heads)
    )
    mask = DocumentMask(cp.shard_sequence(ids), backend="sdpa", context_parallel=cp, windows=WINDOWS)
    errors = {}
    for window, softcap in CASES:
        scale = 0.3 if window == 3 else None
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        want = _reference(*full, ids, window, scale, softcap)
        want.backward(grad)
        local = [cp.shard_sequence(t, dim=2).requires_grad_() for t in (q, k, v)]
        got = mask.attention(*local, scale=scale, window=window, softcap=softcap)
        got.backward(cp.shard_sequence(grad, dim=2))
        diffs = [_rel(got, cp.shard_sequence(want, dim=2))]
        diffs += [_rel(t.grad, cp.shard_sequence(f.grad, dim=2)) for t, f in zip(local, full, strict=True)]
        errors[f"{window}/{softcap}"] = max(diffs)
    return errors


def _flex_errors(cp: ContextParallel) -> dict[str, float]:
    """FlexAttention's path (one block mask over the gathered keys, queries mapped to their global
    positions): its forward (torch has no CPU flex backward) against one process, per window."""
    seq = 2 * cp.size * CHUNK
    ids = _rows(seq)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, seq, 8, generator=gen) for h in (4, 2, 2))
    mask = DocumentMask(cp.shard_sequence(ids), backend="flex", context_parallel=cp, windows=WINDOWS)
    local = [cp.shard_sequence(t, dim=2) for t in (q, k, v)]
    return {
        f"{w}/{c}": float(
            (
                mask.attention(*local, window=w, softcap=c)
                - cp.shard_sequence(_reference(q, k, v, ids, w, None, c), dim=2)
            )
            .abs()
            .max()
        )
        for w, c in CASES
    }


def _rank_main() -> dict[str, object]:
    cp = ContextParallel(dist.group.WORLD)
    return {
        "mha64": _errors(cp, 2, 2, torch.float64),
        "gqa64": _errors(cp, 4, 2, torch.float64),
        "gqa32": _errors(cp, 4, 2, torch.float32),
        "flex": _flex_errors(cp),
    }


@pytest.mark.parametrize("cp", [2, 4])
def test_packed_windowed_attention_on_cp_ranks_equals_one_process(cp):
    for rank, got in enumerate(run_distributed(_rank_main, cp)):
        for case in ("mha64", "gqa64"):
            assert max(got[case].values()) <= 1e-12, (rank, case, got[case])
        assert max(got["gqa32"].values()) <= 2e-6, (rank, got["gqa32"])  # measured 9.1e-7 (soft cap)
        assert max(got["flex"].values()) <= 1e-5, (rank, got["flex"])


def test_the_rows_hold_every_boundary_case():
    """What the cases above claim about `_rows`, checked: at cp 2 a document crosses a chunk boundary,
    one starts exactly at one, one is a single token, one spans the whole row."""
    ids = _rows(4 * CHUNK)
    starts = [i for i in range(1, ids.size(1)) if ids[0, i] != ids[0, i - 1]]
    assert 3 * CHUNK in starts  # a document starts exactly at a chunk boundary
    assert any(ids[0, b - 1] == ids[0, b] for b in range(CHUNK, ids.size(1), CHUNK))  # one crosses one
    assert (ids[0] == ids[0, 0]).sum() == 1 and ids[0, -1] == -1
    assert ids[1].unique().numel() == 1


def test_one_process_windowed_mask_is_the_definition():
    """Without context parallelism the mask object gives the same attention (both kernels' masks)."""
    ids = _rows(16)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 16, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    mask = DocumentMask(ids, backend="sdpa", windows=WINDOWS)
    for window in WINDOWS:
        torch.testing.assert_close(
            mask.attention(q, k, v, window=window), _reference(q, k, v, ids, window, None), rtol=0, atol=1e-12
        )
    flex = DocumentMask(ids.float().long(), backend="flex")
    torch.testing.assert_close(
        flex.attention(q.float(), k.float(), v.float(), window=3),
        _reference(q, k, v, ids, 3, None).float(),
        rtol=1e-5,
        atol=1e-5,
    )
    with pytest.raises(ValueError, match="at least 1 token"):
        mask.attention(q, k, v, window=0)
