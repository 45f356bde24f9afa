"""MoE layer in one process: equal to a token-by-token loop, gradients, aux loss, local-mode parallelize."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from d9d.mesh import DistributedContext, MeshConfig
from d9d.parallel.expert import ExpertParallelError, MoE, moe_aux_loss, parallelize_expert_parallel


def naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its k experts one at a time, straight from the stacked weights."""
    flat = x.reshape(-1, moe.hidden_size)
    route = moe.router(flat)
    e = moe.experts
    rows = []
    for t in range(flat.shape[0]):
        row = torch.zeros(moe.hidden_size)
        for slot in range(moe.top_k):
            i = int(route.indices[t, slot])
            h = F.silu(flat[t] @ e.w_gate[i]) * (flat[t] @ e.w_up[i])
            row = row + route.weights[t, slot] * (h @ e.w_down[i])
        if moe.shared_expert is not None:
            row = row + moe.shared_expert(flat[t])
        rows.append(row)
    return torch.stack(rows).reshape(x.shape)


@pytest.mark.parametrize(("top_k", "shared"), [(1, None), (2, 8), (3, None)])
def test_moe_equals_a_token_by_token_loop(top_k, shared):
    torch.manual_seed(0)
    moe = MoE(12, 10, 5, top_k, shared_ffn_size=shared)
    x = torch.randn(3, 4, 12)
    out = moe(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, naive_moe(moe, x))


def test_experts_that_receive_no_token_get_zero_gradients():
    torch.manual_seed(0)
    moe = MoE(8, 6, 4, 1)
    with torch.no_grad():  # steer every token away from experts 2 and 3
        moe.router.gate.weight[2:] = -10.0 * moe.router.gate.weight[:2].abs().sum(0)
    x = torch.rand(10, 8) + 0.1
    moe(x).sum().backward()
    assert moe.last_stats is not None
    assert moe.last_stats.tokens_per_expert[2:].tolist() == [0, 0]
    for weight in moe.experts.parameters():
        assert weight.grad is not None
        assert torch.count_nonzero(weight.grad[2:]) == 0
        assert torch.count_nonzero(weight.grad[:2]) > 0


def test_moe_aux_loss_sums_every_layer_of_the_last_forward():
    torch.manual_seed(0)
    model = nn.Sequential(MoE(8, 6, 4, 2), MoE(8, 6, 4, 2))
    assert float(moe_aux_loss(model)) == 0.0
    model(torch.randn(5, 8))
    expected = model[0].last_stats.aux_loss + model[1].last_stats.aux_loss
    torch.testing.assert_close(moe_aux_loss(model), expected)
    moe_aux_loss(model).backward()
    assert model[0].router.gate.weight.grad is not None


def test_parallelize_in_local_mode_changes_nothing():
    torch.manual_seed(0)
    moe = MoE(8, 6, 4, 2)
    before = {n: p.detach().clone() for n, p in moe.named_parameters()}
    x = torch.randn(5, 8)
    expected = moe(x)
    with DistributedContext.from_env(MeshConfig(), environ={}) as ctx:
        assert parallelize_expert_parallel(moe, ctx) is moe
    assert all(type(p) is nn.Parameter and torch.equal(p, before[n]) for n, p in moe.named_parameters())
    torch.testing.assert_close(moe(x), expected)


def test_parallelize_rejects_a_module_without_moe():
    with (
        DistributedContext.from_env(MeshConfig(), environ={}) as ctx,
        pytest.raises(ExpertParallelError, match=r"no d9d\.parallel\.expert\.MoE"),
    ):
        parallelize_expert_parallel(nn.Linear(2, 2), ctx)
