"""Load-balance statistics of a router: tokens per expert and the auxiliary balance loss.

The auxiliary loss is the Switch-Transformer one generalised to top-k:
`num_experts × Σ_e f_e · P_e`, with `f_e` the fraction of the T·k routing slots that chose expert e
and `P_e` the mean router probability of e over the T tokens. It is 1 for a perfectly uniform router.

Under data parallelism the statistics are taken over the whole batch of the data-parallel group (the
`group` argument), to match one process that sees the global batch: the counts are all-reduced, and
each rank returns its *share* of the loss (its tokens' probabilities divided by the global token
count). The shares sum to the global loss, which fits the d9d gradient contract (losses are
normalised by the global count and gradients are summed over data-parallel ranks).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["LoadBalanceStats", "expert_counts", "load_balance_stats"]


@dataclass(frozen=True)
class LoadBalanceStats:
    """Statistics of one MoE forward.

    Attributes:
        tokens_per_expert: [num_experts] routing slots per expert over the data-parallel group
            (int64, no grad): the numbers to log to spot dead or overloaded experts.
        aux_loss: scalar fp32 load-balance loss (with grad through the router probabilities); on a
            data-parallel run this rank's share, the shares summing to the loss of the global batch.
            Scale it by a coefficient and add it to the training loss.
        z_loss: scalar fp32 router z-loss, the mean over the global batch's tokens of
            logsumexp(logits)² (ST-MoE), which keeps the gate's logits small; this rank's share like
            `aux_loss` (zero when no logits were given).
    """

    tokens_per_expert: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routing slots per expert (int64 [num_experts]) of the flat chosen ids, on their device.

    A scatter-add, not `torch.bincount`: CUDA's bincount reads the largest id back to size its
    output (a host sync); the number of experts is known.
    """
    flat = expert_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


def load_balance_stats(
    probs: torch.Tensor,
    indices: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    logits: torch.Tensor | None = None,
) -> LoadBalanceStats:
    """Statistics of a routing decision: `probs` [T, E] (softmax), `indices` [T, k] chosen experts.

    Args:
        group: the ranks whose tokens form one batch (data-parallel ranks); None for this rank only.
        logits: [T, E] the gate's logits, for the z-loss (None: a zero z-loss).
    """
    num_tokens, num_experts = probs.shape
    top_k = indices.shape[-1]
    counts = expert_counts(indices, num_experts).to(torch.float64)
    totals = torch.cat([counts, counts.new_tensor([float(num_tokens)])])
    if group is not None:
        dist.all_reduce(totals, group=group)
    global_counts, global_tokens = totals[:-1], totals[-1]
    slot_fraction = (global_counts / (global_tokens * top_k).clamp(min=1)).to(torch.float32)
    prob_share = probs.float().sum(dim=0) / global_tokens.clamp(min=1).to(torch.float32)
    aux_loss = num_experts * torch.sum(slot_fraction * prob_share)
    if logits is None:
        z_loss = aux_loss.new_zeros(())
    else:
        z_loss = torch.logsumexp(logits.float(), dim=-1).square().sum() / global_tokens.clamp(min=1).to(
            torch.float32
        )
    return LoadBalanceStats(tokens_per_expert=global_counts.to(torch.int64), aux_loss=aux_loss, z_loss=z_loss)
