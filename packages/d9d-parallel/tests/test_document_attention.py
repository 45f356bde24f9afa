"""`DocumentMask`: attention over packed documents equals each document run alone, with either kernel."""

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter

from d9d.parallel import DocumentMask, document_attention_backend
from d9d.parallel import document_attention as module

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


def _layout(batch: int, seq: int, seed: int) -> torch.Tensor:
    """Document ids of `batch` packed rows: 1-5 documents of random lengths per row."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, seq, generator=gen) < 5 / seq
    return starts.cumsum(1)


def _causal(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """The block-mask builder's arguments for one process, no window: keys' ids, query positions."""
    return ids, torch.arange(ids.size(1)), None


@pytest.fixture
def counted_compile(monkeypatch):
    """torch.compile with dynamo's counting backend (graphs are counted, not lowered by inductor),
    for the CUDA path's mask builder; a fresh builder and compile caches before and after."""
    counter, calls, real = CompileCounter(), [], torch.compile

    def compile_counting(fn, **kwargs):
        calls.append(kwargs)
        return real(fn, backend=counter, **kwargs)

    torch._dynamo.reset()
    monkeypatch.setattr(module, "_compiled", {})
    monkeypatch.setattr(torch, "compile", compile_counting)
    yield counter, calls
    torch._dynamo.reset()


def test_the_cuda_block_mask_builder_compiles_once_for_every_document_layout(counted_compile):
    """CUDA builds the mask with one compiled function (here compiled on CPU, where it runs the same).

    Measured (torch 2.15): 1 graph for every layout of one length; a second length recompiles once
    with the length dynamic; later lengths reuse it (2 graphs). `create_block_mask(_compile=True)`,
    used before, compiled the same graphs but is deprecated and wrapped compile on every call.
    """
    counter, calls = counted_compile
    builder = module._mask_builder(torch.device("cuda"))
    for seed in range(3):
        ids = _layout(2, 256, seed)
        assert torch.equal(
            builder(*_causal(ids)).to_dense(), module._build_block_mask(*_causal(ids)).to_dense()
        ), seed
    assert counter.frame_count == 1
    assert module._mask_builder(torch.device("cuda")) is builder and len(calls) == 1
    for seq, graphs in ((384, 2), (512, 2), (384, 2)):  # an eval set of another length, and a third
        ids = _layout(2, seq, seq)
        assert torch.equal(
            builder(*_causal(ids)).to_dense(), module._build_block_mask(*_causal(ids)).to_dense()
        ), seq
        assert counter.frame_count == graphs, seq
    assert module._mask_builder(torch.device("cpu")) is module._build_block_mask  # eager off CUDA


def test_the_cuda_block_mask_of_a_context_parallel_rank_compiles_once_per_window(counted_compile):
    """Under context parallelism the builder takes this rank's query positions against the whole row's
    keys (a [seq / cp, seq] block mask). New document layouts reuse the graph; a window is one more
    graph (its value is a constant of the mask function), and further layouts reuse that one too."""
    from d9d.parallel.context_parallel import _positions

    counter, _ = counted_compile
    builder = module._mask_builder(torch.device("cuda"))
    positions = _positions(512, 2, 1)  # cp 2, rank 1: chunks 1 and 2 of 4
    for window, graphs in ((None, 1), (100, 2)):
        for seed in range(3):
            ids = _layout(2, 512, seed)
            got = builder(ids, positions, window).to_dense()
            assert torch.equal(got, module._build_block_mask(ids, positions, window).to_dense()), seed
            assert counter.frame_count == graphs, (window, seed)
