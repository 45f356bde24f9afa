"""Load-balance statistics: tokens per expert and the auxiliary loss, local and over 2 ranks (data or
context parallel)."""

import torch

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel.expert import MoE, MoEBalancing, load_balance_stats, parallelize_expert_parallel


def test_tokens_per_expert_counts_every_routing_slot():
    indices = torch.tensor([[0, 2], [2, 3], [0, 2]])
    probs = torch.full((3, 5), 0.2)
    stats = load_balance_stats(probs, indices)
    assert stats.tokens_per_expert.tolist() == [2, 0, 3, 1, 0]


def test_aux_loss_is_one_for_a_uniform_balanced_router_and_larger_when_collapsed():
    probs = torch.full((4, 4), 0.25)
    balanced = load_balance_stats(probs, torch.tensor([[0], [1], [2], [3]]))
    torch.testing.assert_close(balanced.aux_loss, torch.tensor(1.0))
    collapsed_probs = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(4, 1)
    collapsed = load_balance_stats(collapsed_probs, torch.zeros(4, 1, dtype=torch.long))
    torch.testing.assert_close(collapsed.aux_loss, torch.tensor(4 * 1.0 * 0.7))


def test_aux_loss_formula_and_gradient_through_the_probabilities():
    torch.manual_seed(0)
    logits = torch.randn(6, 4, requires_grad=True)
    probs = torch.softmax(logits, dim=-1)
    indices = torch.topk(probs, 2, dim=-1).indices
    stats = load_balance_stats(probs, indices)
    fraction = torch.bincount(indices.reshape(-1), minlength=4).float() / (6 * 2)
    torch.testing.assert_close(stats.aux_loss, 4 * (fraction * probs.mean(dim=0)).sum())
    stats.aux_loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def _shares_over_two_ranks(probs: torch.Tensor, indices: torch.Tensor, split: int):
    ctx = DistributedContext.from_env(MeshConfig(data_parallel_shard=2))
    rows = slice(0, split) if ctx.rank == 0 else slice(split, None)
    stats = load_balance_stats(probs[rows], indices[rows], group=ctx.mesh("batch")["dp"].get_group())
    ctx.close()
    return stats.tokens_per_expert, stats.aux_loss.detach()


def test_aux_loss_shares_over_data_parallel_ranks_sum_to_the_global_batch_loss_2ranks():
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(7, 4), dim=-1)
    indices = torch.topk(probs, 2, dim=-1).indices
    reference = load_balance_stats(probs, indices)
    results = run_distributed(_shares_over_two_ranks, 2, probs, indices, 3)  # uneven: 3 and 4 tokens
    for counts, _ in results:
        assert torch.equal(counts, reference.tokens_per_expert)
    torch.testing.assert_close(results[0][1] + results[1][1], reference.aux_loss)


def _moe() -> MoE:
    torch.manual_seed(3)
    return MoE(16, 32, 4, 2, balancing=MoEBalancing(aux_loss_coef=1.0, z_loss_coef=1.0))


def _tokens() -> torch.Tensor:
    return torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(4))


def _expert_parallel_over_context_ranks() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ctx = DistributedContext.from_env(MeshConfig(context_parallel=2, expert_parallel=2))
    moe = parallelize_expert_parallel(_moe(), ctx)
    moe(_tokens().chunk(2, dim=1)[ctx.coordinate("cp")])  # each cp rank holds half of every sequence
    stats = moe.last_stats
    ctx.close()
    return stats.tokens_per_expert, stats.aux_loss.detach(), stats.z_loss.detach()


def test_expert_parallel_statistics_span_the_context_parallel_ranks_2ranks():
    """Context-parallel ranks hold different tokens of the same sequences and sum their gradients: the
    statistics of an expert-parallel layer are taken over them, each rank's losses its share."""
    moe = _moe()
    moe(_tokens())
    reference = moe.last_stats
    assert reference is not None
    results = run_distributed(_expert_parallel_over_context_ranks, 2)
    for counts, _, _ in results:
        assert torch.equal(counts, reference.tokens_per_expert)
    torch.testing.assert_close(results[0][1] + results[1][1], reference.aux_loss.detach())
    torch.testing.assert_close(results[0][2] + results[1][2], reference.z_loss.detach())
