"""`DocumentMask`: attention over packed documents equals each document run alone, with either kernel."""

import pytest
import torch
import torch.nn.functional as F

from d9d.parallel import DocumentMask, document_attention_backend

#: Two rows: documents of 20, 1, 29 and 10 tokens then 4 of padding (-1); one document filling the row.
IDS = torch.tensor([[0] * 20 + [1] + [2] * 29 + [3] * 10 + [-1] * 4, [5] * 64])


def _qkv(heads: int, kv_heads: int, dtype: torch.dtype = torch.float64, grad: bool = True):
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(2, h, 64, 16, generator=gen, dtype=dtype).requires_grad_(grad)
        for h in (heads, kv_heads, kv_heads)
    ]


def _one_by_one(q, k, v, ids):
    """Each document (and the padding) alone, with the plain causal kernel."""
    out = torch.zeros_like(q)
    for row in range(ids.shape[0]):
        for doc in ids[row].unique():
            at = (ids[row] == doc).nonzero().squeeze(1)
            part = F.scaled_dot_product_attention(
                q[row : row + 1, :, at], k[row : row + 1, :, at], v[row : row + 1, :, at],
                is_causal=True, enable_gqa=q.shape[1] != k.shape[1],
            )  # fmt: skip
            out[row : row + 1, :, at] = part
    return out


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1)])
def test_sdpa_kernel_forward_and_backward_equal_the_documents_run_alone(heads, kv_heads):
    q, k, v = _qkv(heads, kv_heads)
    mask = DocumentMask(IDS, backend="sdpa")
    got = mask.attention(q, k, v)
    want = _one_by_one(q, k, v, IDS)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(got)
    for a, b in zip(
        torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2)])
def test_flex_kernel_equals_the_sdpa_kernel(heads, kv_heads):
    # torch has FlexAttention's forward only on CPU (eager); its backward runs on CUDA
    q, k, v = _qkv(heads, kv_heads, torch.float32, grad=False)
    flex = DocumentMask(IDS, backend="flex")
    assert flex.backend == "flex"
    torch.testing.assert_close(
        flex.attention(q, k, v), DocumentMask(IDS, backend="sdpa").attention(q, k, v), rtol=1e-5, atol=1e-6
    )


def test_auto_picks_flex_on_cuda_and_sdpa_elsewhere():
    assert document_attention_backend(torch.device("cpu")) == "sdpa"
    assert document_attention_backend(torch.device("cuda", 0)) == "flex"
    assert document_attention_backend(torch.device("cuda"), "sdpa") == "sdpa"
    assert DocumentMask(IDS).backend == "sdpa"
    with pytest.raises(ValueError, match="'auto', 'flex' or 'sdpa'"):
        document_attention_backend(torch.device("cpu"), "flash")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        DocumentMask(IDS[0])


def test_the_dense_mask_is_block_causal():
    mask = DocumentMask(torch.tensor([[0, 0, 1, 1, 1]]), backend="sdpa").dense()[0, 0]
    want = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]],
        dtype=torch.bool,
    )
    assert torch.equal(mask, want)
