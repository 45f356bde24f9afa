"""TopKRouter: top-k of the softmax, renormalisation, config errors."""

import pytest
import torch

from d9d.mesh import D9dError
from d9d.parallel.expert import ExpertParallelError, TopKRouter


def make_router(renormalize: bool) -> tuple[TopKRouter, torch.Tensor]:
    torch.manual_seed(0)
    return TopKRouter(16, 6, 2, renormalize=renormalize), torch.randn(10, 16)


def test_router_picks_the_top_k_probabilities_in_order():
    router, x = make_router(renormalize=False)
    out = router(x)
    probs = torch.softmax(x @ router.gate.weight.t(), dim=-1)
    torch.testing.assert_close(out.probs, probs)
    assert out.indices.shape == (10, 2) and out.weights.shape == (10, 2)
    expected = torch.sort(probs, dim=-1, descending=True)
    torch.testing.assert_close(out.weights, expected.values[:, :2])
    assert torch.equal(out.indices, expected.indices[:, :2])
    torch.testing.assert_close(out.weights, probs.gather(1, out.indices))


def test_router_renormalises_the_k_weights():
    router, x = make_router(renormalize=True)
    out = router(x)
    torch.testing.assert_close(out.weights.sum(dim=-1), torch.ones(10))
    raw = out.probs.gather(1, out.indices)
    torch.testing.assert_close(out.weights, raw / raw.sum(dim=-1, keepdim=True))


def test_router_weights_carry_gradient_to_the_gate():
    router, x = make_router(renormalize=True)
    out = router(x)
    (out.weights * torch.arange(2.0)).sum().backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("top_k", [0, 7])
def test_router_rejects_top_k_outside_the_experts(top_k):
    with pytest.raises(ExpertParallelError, match="top_k") as info:
        TopKRouter(16, 6, top_k)
    assert isinstance(info.value, D9dError)
