"""d9d.parallel.expert: an MoE layer in plain PyTorch, all-to-all token dispatch, expert sharding over ep.

from d9d.parallel.expert import MoE, moe_aux_loss, parallelize_expert_parallel

moe = MoE(hidden_size=32, ffn_size=64, num_experts=4, top_k=2)
parallelize_expert_parallel(model, ctx)      # before data parallelism of the rest of the model
loss = task_loss + 0.01 * moe_aux_loss(model)
with record_routing(model) as routing: ...     # the experts each layer chose, per forward
with replay_routing(model, per_layer): ...      # the same experts again (RL: sampling's, in training)
"""

from typing import TYPE_CHECKING

from d9d.mesh.lazy import lazy_face

if TYPE_CHECKING:  # the public names, listed once: `lazy_face` reads this block
    from d9d.parallel.expert.balancing import (
        expert_load_summary,
        expert_loads,
        moe_layers,
        moe_regularization_loss,
        moe_score_bias_names,
        set_statistics_group,
        update_expert_biases,
    )
    from d9d.parallel.expert.dispatch import (
        AllToAllDispatcher,
        ExpertFn,
        LocalDispatcher,
        TokenDispatcher,
        expert_major_order,
    )
    from d9d.parallel.expert.errors import ExpertParallelError
    from d9d.parallel.expert.experts import GroupedExperts, SwiGLU, grouped_mm_fits
    from d9d.parallel.expert.load_balance import LoadBalanceStats, expert_counts, load_balance_stats
    from d9d.parallel.expert.moe import MoE, MoEBalancing, moe_aux_loss
    from d9d.parallel.expert.parallelize import parallelize_expert_parallel
    from d9d.parallel.expert.router import (
        RouterOutput,
        TopKRouter,
        record_routing,
        replay_routing,
        set_replayed_routing,
    )

__all__, __getattr__, __dir__ = lazy_face(__name__, globals())
