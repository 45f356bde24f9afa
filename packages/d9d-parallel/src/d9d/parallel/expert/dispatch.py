"""Token dispatch: how tokens sorted by expert reach the ranks that hold those experts and come back.

A dispatcher receives the routed copies of the tokens sorted by global expert id and the number of
copies per expert, runs the experts on them wherever they live, and returns their outputs in the
same order. `LocalDispatcher` calls the local experts directly (no collectives, no host read);
`AllToAllDispatcher` sends each copy to the expert-parallel rank holding its expert with an
all-to-all (uneven and zero-size splits allowed, autograd through it) and brings the outputs back
with a second one. The all-to-all's split sizes are the one value a layer reads on the host
(`all_to_all_single` takes them as Python ints): one `.tolist()` of the send and receive splits.
"""

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from d9d.parallel.expert.errors import ExpertParallelError

__all__ = [
    "AllToAllDispatcher",
    "ExpertFn",
    "LocalDispatcher",
    "TokenDispatcher",
    "expert_major_order",
]

#: Runs the rank's local experts: (tokens grouped by local expert, rows per local expert as an integer
#: tensor on the tokens' device) → outputs.
ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class TokenDispatcher(Protocol):
    """Runs experts on tokens sorted by global expert id, wherever the experts live."""

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, experts: ExpertFn) -> torch.Tensor:
        """`tokens` [N, hidden] sorted by expert, `counts` [num_experts] rows per expert → outputs [N, hidden]."""
        ...


class LocalDispatcher:
    """Every expert is on this rank: call them directly."""

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, experts: ExpertFn) -> torch.Tensor:
        """Run `experts` on `tokens` grouped by `counts`."""
        return experts(tokens, counts)


class AllToAllDispatcher:
    """Experts sharded over the ranks of `group`: rank r holds experts [r·E/ep, (r+1)·E/ep)."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group = group
        self.ep_size = dist.get_world_size(group)
        if num_experts % self.ep_size != 0:
            raise ExpertParallelError(
                f"num_experts={num_experts} is not divisible by expert_parallel={self.ep_size}; "
                "choose an expert_parallel degree that divides the number of experts"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, experts: ExpertFn) -> torch.Tensor:
        """Send each token to its expert's rank, run the local experts there, return the outputs."""
        send_counts = counts.reshape(self.ep_size, self.num_local_experts).contiguous()
        # recv_counts[s, j]: tokens that rank s sends to local expert j of this rank.
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        splits = torch.stack([send_counts.sum(dim=1), recv_counts.sum(dim=1)]).tolist()  # the one host read
        send_splits, recv_splits = splits[0], splits[1]
        received = all_to_all_single_autograd(tokens, recv_splits, send_splits, self.group)
        order = expert_major_order(recv_counts, total=sum(recv_splits))
        outputs = experts(received[order], recv_counts.sum(dim=0))
        back = outputs[torch.argsort(order)]
        return all_to_all_single_autograd(back, send_splits, recv_splits, self.group)


def expert_major_order(counts: torch.Tensor, *, total: int | None = None) -> torch.Tensor:
    """Gather index that regroups rows laid out source-major into expert-major order.

    `counts[s, j]` rows came from source s for expert j, laid out s-major (s0e0, s0e1, …, s1e0, …).
    Returns `index` such that `rows[index]` is laid out j-major (e0s0, e0s1, …, e1s0, …), each
    block keeping its internal order. `total` is `counts.sum()` when the caller knows it on the host
    already (else it is read here: a host sync).
    """
    flat = counts.reshape(-1)
    starts = torch.cumsum(flat, dim=0) - flat
    block_sizes = counts.t().reshape(-1)
    block_starts = starts.reshape(counts.shape).t().reshape(-1)
    total = int(flat.sum()) if total is None else total
    within = torch.arange(total, device=counts.device) - torch.repeat_interleave(
        torch.cumsum(block_sizes, dim=0) - block_sizes, block_sizes, output_size=total
    )
    return torch.repeat_interleave(block_starts, block_sizes, output_size=total) + within
