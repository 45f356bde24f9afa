"""Expert MLPs: SwiGLU, and a bank of SwiGLU experts stored as stacked weights."""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["GroupedExperts", "SwiGLU"]


class SwiGLU(nn.Module):
    """The gated MLP `down(silu(gate(x)) * up(x))`; used as the shared expert."""

    def __init__(self, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, ffn_size, bias=False)
        self.up = nn.Linear(hidden_size, ffn_size, bias=False)
        self.down = nn.Linear(ffn_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to `x` of shape [..., hidden]."""
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts as stacked weights: w_gate/w_up [E, hidden, ffn], w_down [E, ffn, hidden].

    Stacking makes expert parallelism a dim-0 shard of three tensors and keeps checkpoint keys
    independent of the layout. After `parallelize_expert_parallel` the weights are DTensors sharded
    on dim 0 and this module holds (and computes with) only its rank's experts.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_size = ffn_size
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size))
        self.w_down = nn.Parameter(torch.empty(num_experts, ffn_size, hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform init with bound 1/sqrt(fan_in), as `nn.Linear` does for its weight."""
        for weight, fan_in in ((self.w_gate, self.hidden_size), (self.w_up, self.hidden_size)):
            nn.init.uniform_(weight, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        nn.init.uniform_(self.w_down, -1 / math.sqrt(self.ffn_size), 1 / math.sqrt(self.ffn_size))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Run the local experts on `x` [N, hidden], grouped by expert: `counts[j]` rows for local expert j.

        Groups may be empty; every expert weight still gets a (zero) gradient.
        """
        w_gate, w_up, w_down = _local(self.w_gate), _local(self.w_up), _local(self.w_down)
        outputs = []
        for j, x_j in enumerate(torch.split(x, counts, dim=0)):
            outputs.append((F.silu(x_j @ w_gate[j]) * (x_j @ w_up[j])) @ w_down[j])
        return torch.cat(outputs, dim=0)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """The rank-local part of an expert weight (the weight itself when it is not a DTensor)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight
