"""`MoE`: a mixture-of-experts feed-forward layer (top-k router, grouped SwiGLU experts, shared expert)."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from d9d.parallel.expert.dispatch import LocalDispatcher, TokenDispatcher
from d9d.parallel.expert.experts import GroupedExperts, SwiGLU
from d9d.parallel.expert.load_balance import LoadBalanceStats, expert_counts, load_balance_stats
from d9d.parallel.expert.router import TopKRouter

__all__ = ["MoE", "MoEBalancing", "moe_aux_loss"]


@dataclass(frozen=True)
class MoEBalancing:
    """How one MoE layer is balanced (all off by default).

    Attributes:
        aux_loss_coef: weight of the auxiliary load-balance loss in the training loss.
        z_loss_coef: weight of the router z-loss in the training loss.
        bias_update_rate: step of the auxiliary-loss-free score bias per optimizer step (0: no bias).
    """

    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        values = {"aux_loss_coef": self.aux_loss_coef, "z_loss_coef": self.z_loss_coef,
                  "bias_update_rate": self.bias_update_rate}  # fmt: skip
        for name, value in values.items():
            if value < 0:
                raise ValueError(f"MoEBalancing.{name} must be >= 0, got {value}")

    @property
    def adds_loss(self) -> bool:
        """Whether the layer adds a term to the training loss."""
        return self.aux_loss_coef > 0 or self.z_loss_coef > 0


class MoE(nn.Module):
    """Mixture-of-experts layer: each token goes through its top-k experts, weighted by the router.

    Capacity-free: no token is dropped, however unevenly the router distributes them. Plain PyTorch
    in a single process; `parallelize_expert_parallel` swaps in an all-to-all dispatcher and shards
    the experts, and the layer then computes the same thing. After every forward, `last_stats` holds
    the load-balance statistics (tokens per expert, auxiliary loss) of that forward.

    Args:
        hidden_size: model width.
        ffn_size: hidden width of each routed expert.
        num_experts: routed experts.
        top_k: experts per token.
        renormalize: rescale each token's k router weights to sum to 1.
        shared_ffn_size: hidden width of a shared expert that every token also goes through
            (None: no shared expert).
        balancing: the layer's load-balancing levers (`MoEBalancing`, all off by default; a
            `bias_update_rate` gives the router its score bias).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        top_k: int,
        *,
        renormalize: bool = True,
        shared_ffn_size: int | None = None,
        balancing: MoEBalancing | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.balancing = balancing or MoEBalancing()
        self.router = TopKRouter(
            hidden_size,
            num_experts,
            top_k,
            renormalize=renormalize,
            score_bias=self.balancing.bias_update_rate > 0,
        )
        self.experts = GroupedExperts(num_experts, hidden_size, ffn_size)
        self.shared_expert = SwiGLU(hidden_size, shared_ffn_size) if shared_ffn_size else None
        self.dispatcher: TokenDispatcher = LocalDispatcher()
        self.stats_group: dist.ProcessGroup | None = None
        self.last_stats: LoadBalanceStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer to `x` [..., hidden]; the output has the shape of `x`."""
        flat = x.reshape(-1, self.hidden_size)
        route = self.router(flat)
        self.last_stats = load_balance_stats(
            route.probs,
            route.indices,
            group=self.stats_group,
            logits=route.logits if self.balancing.z_loss_coef else None,
        )

        expert_ids = route.indices.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)
        token_ids = order // self.top_k
        counts = expert_counts(expert_ids, self.num_experts)
        routed = self.dispatcher(flat[token_ids], counts, self.experts)
        weighted = routed * route.weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(flat).index_add(0, token_ids, weighted)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return out.reshape(x.shape)


def moe_aux_loss(module: nn.Module) -> torch.Tensor:
    """Sum of the load-balance losses of every `MoE` in `module` from their last forward (0 if none ran)."""
    losses = [m.last_stats.aux_loss for m in module.modules() if isinstance(m, MoE) and m.last_stats]
    return torch.stack(losses).sum() if losses else torch.zeros(())
