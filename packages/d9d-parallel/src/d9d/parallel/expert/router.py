"""Top-k token router: which experts each token goes to, and with what weight."""

from dataclasses import dataclass

import torch
from torch import nn

from d9d.parallel.expert.errors import ExpertParallelError

__all__ = ["RouterOutput", "TopKRouter"]


@dataclass(frozen=True)
class RouterOutput:
    """Routing decision for a flat batch of T tokens with k experts each.

    Attributes:
        weights: [T, k] gate weights that scale each chosen expert's output (dtype of the input).
        indices: [T, k] chosen expert ids (int64), highest probability first.
        probs: [T, num_experts] softmax over all experts in fp32 (for the load-balance loss).
    """

    weights: torch.Tensor
    indices: torch.Tensor
    probs: torch.Tensor


class TopKRouter(nn.Module):
    """Linear gate → softmax over experts (fp32) → top-k; optionally renormalise the k weights to sum 1."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, renormalize: bool = True) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ExpertParallelError(
                f"MoE top_k={top_k} must be between 1 and num_experts={num_experts}; lower top_k"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """Route `x` of shape [T, hidden]."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return RouterOutput(weights=weights.to(x.dtype), indices=indices, probs=probs)
