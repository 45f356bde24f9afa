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
        indices: [T, k] chosen expert ids (int64), highest score first.
        probs: [T, num_experts] softmax over all experts in fp32 (for the load-balance loss).
        logits: [T, num_experts] the gate's logits in fp32 (for the router z-loss).
    """

    weights: torch.Tensor
    indices: torch.Tensor
    probs: torch.Tensor
    logits: torch.Tensor


class TopKRouter(nn.Module):
    """Linear gate → softmax over experts (fp32) → top-k; optionally renormalise the k weights to sum 1.

    With `score_bias` the experts are chosen by probability + a per-expert bias (the buffer
    `score_bias`, model state: checkpointed, never trained by gradients) while the weights stay the
    probabilities: the auxiliary-loss-free balancing of DeepSeek-V3, whose bias moves each step
    towards the experts that got fewer tokens (`d9d.parallel.expert.update_expert_biases`).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        renormalize: bool = True,
        score_bias: bool = False,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ExpertParallelError(
                f"MoE top_k={top_k} must be between 1 and num_experts={num_experts}; lower top_k"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.score_bias: torch.Tensor | None
        if score_bias:
            self.register_buffer("score_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.score_bias = None

    def reset_parameters(self) -> None:
        """A fresh score bias is zero (the gate is an `nn.Linear`, initialized as one)."""
        if self.score_bias is not None:
            with torch.no_grad():
                self.score_bias.zero_()

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """Route `x` of shape [T, hidden]."""
        logits = self.gate(x).float()
        probs = torch.softmax(logits, dim=-1)
        if self.score_bias is None:
            weights, indices = torch.topk(probs, self.top_k, dim=-1)
        else:  # the bias picks the experts; the weights stay the probabilities
            indices = torch.topk(probs.detach() + self.score_bias, self.top_k, dim=-1).indices
            weights = probs.gather(-1, indices)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return RouterOutput(weights=weights.to(x.dtype), indices=indices, probs=probs, logits=logits)
