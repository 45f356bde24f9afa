"""Expert parallelism: an MoE layer in plain PyTorch, all-to-all token dispatch, expert sharding over ep.

moe = MoE(hidden_size=32, ffn_size=64, num_experts=4, top_k=2)
parallelize_expert_parallel(model, ctx)      # before data parallelism of the rest of the model
loss = task_loss + 0.01 * moe_aux_loss(model)
"""

from d9d.parallel.expert.dispatch import (
    AllToAllDispatcher,
    ExpertFn,
    LocalDispatcher,
    TokenDispatcher,
    expert_major_order,
)
from d9d.parallel.expert.errors import ExpertParallelError
from d9d.parallel.expert.experts import GroupedExperts, SwiGLU
from d9d.parallel.expert.load_balance import LoadBalanceStats, load_balance_stats
from d9d.parallel.expert.moe import MoE, moe_aux_loss
from d9d.parallel.expert.parallelize import parallelize_expert_parallel
from d9d.parallel.expert.router import RouterOutput, TopKRouter

__all__ = [
    "AllToAllDispatcher",
    "ExpertFn",
    "ExpertParallelError",
    "GroupedExperts",
    "LoadBalanceStats",
    "LocalDispatcher",
    "MoE",
    "RouterOutput",
    "SwiGLU",
    "TokenDispatcher",
    "TopKRouter",
    "expert_major_order",
    "load_balance_stats",
    "moe_aux_loss",
    "parallelize_expert_parallel",
]
