"""How MoE layers are kept balanced during training, and what a step reports about their load.

Three levers, each off by default (`MoEBalancing`), set per layer:
- the auxiliary load-balance loss (Switch Transformer's, `LoadBalanceStats.aux_loss`) and the router
  z-loss (ST-MoE's, `LoadBalanceStats.z_loss`), added to the training loss with their coefficients
  (`moe_regularization_loss`);
- auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias on the router's scores chooses the
  experts (not their weights); after every optimizer step it moves by `bias_update_rate` towards
  the experts that got fewer tokens than the mean, b_e += rate · sign(mean − load_e)
  (`update_expert_biases`), on the device, with no host read. The bias is model state: it is
  checkpointed and resumes exactly.

The load of a step is the routing slots per expert of every MoE layer, summed over the step's
microbatches and the data-parallel ranks (`expert_loads` after each microbatch);
`expert_load_summary` turns it into the three numbers a step records: the least and the most loaded
expert relative to the mean, and the coefficient of variation (std / mean), worst layer first.

How the two losses add up over a step (what "the same global batch" means for them). A microbatch's
statistics are taken over its tokens on every rank that holds part of it, the ranks whose gradients
are summed (data × context parallel: `set_statistics_group`, which the trainer's step applies with
or without expert parallelism), each rank adding its share. A step of n microbatches adds each
microbatch's terms divided by n, so they weigh the same whatever the number of microbatches, as the
task's loss does. The z-loss is a mean over tokens: the same for any split of the global batch into
microbatches or over ranks. The auxiliary loss multiplies two means over the tokens counted
together, so it is the mean over the step's microbatches of each one's loss, a microbatch being the
i-th microbatch of every data-parallel rank together (dp × microbatch_size samples): n microbatches
of identical data give that microbatch's loss, and dp ranks of one microbatch each give one process
with the global batch in one microbatch; other splits of distinct data differ, as they would in one
process with another microbatch size.
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from d9d.parallel.expert.moe import MoE, MoEBalancing

__all__ = [
    "MoEBalancing",
    "expert_load_summary",
    "expert_loads",
    "moe_layers",
    "moe_regularization_loss",
    "moe_score_bias_names",
    "set_statistics_group",
    "update_expert_biases",
]


def moe_layers(module: nn.Module) -> list[MoE]:
    """The `MoE` layers of `module`, in module order (take it once: the step's helpers below use it)."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def set_statistics_group(layers: Sequence[MoE], group: dist.ProcessGroup | None) -> None:
    """Take the layers' load-balance statistics (token counts, balancing losses) over `group`: the ranks
    holding different tokens of each microbatch, whose gradients are summed (data × context parallel).
    None, or a group of one rank: this rank's tokens alone."""
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    for layer in layers:
        layer.stats_group = group


def moe_score_bias_names(module: nn.Module) -> list[str]:
    """The state-dict names of the MoE routers' score biases in `module`: training state that no
    pretrained checkpoint holds (an import leaves them at zero)."""
    return [
        f"{name}.router.score_bias" if name else "router.score_bias"
        for name, layer in module.named_modules()
        if isinstance(layer, MoE) and layer.router.score_bias is not None
    ]


def moe_regularization_loss(layers: Sequence[MoE]) -> torch.Tensor | None:
    """Σ over `layers` of aux_loss_coef · aux loss + z_loss_coef · z-loss of their last forward; None
    when no layer adds a loss. Each term is this rank's share of the microbatch's global loss, like
    the task's loss divided by the global weight."""
    terms = []
    for layer in layers:
        balancing, stats = layer.balancing, layer.last_stats
        if not balancing.adds_loss or stats is None:
            continue
        terms.append(balancing.aux_loss_coef * stats.aux_loss + balancing.z_loss_coef * stats.z_loss)
    return torch.stack(terms).sum() if terms else None


def expert_loads(layers: Sequence[MoE]) -> torch.Tensor | None:
    """[layers, experts] routing slots per expert of each layer's last forward (over the data-parallel
    ranks), float32 on the device; None without layers (or before any forward)."""
    stats = [layer.last_stats for layer in layers]
    if not stats or any(s is None for s in stats):
        return None
    counts = [s.tokens_per_expert.float() for s in stats if s is not None]
    width = max(c.numel() for c in counts)  # layers with fewer experts: padded with the row's mean
    return torch.stack(
        [F.pad(c, (0, width - c.numel()), value=float(0)) if c.numel() < width else c for c in counts]
    )


def update_expert_biases(layers: Sequence[MoE], loads: torch.Tensor) -> None:
    """After an optimizer step: each layer's score bias moves by its rate towards the experts that got
    fewer routing slots than the mean in `loads` (a row per layer, `expert_loads` summed over the
    step's microbatches). Layers without a bias are left alone; no host read."""
    with torch.no_grad():
        for layer, load in zip(layers, loads, strict=True):
            bias = layer.router.score_bias
            rate = layer.balancing.bias_update_rate
            if bias is None or rate <= 0:
                continue
            load = load[: bias.numel()]
            bias.add_(rate * torch.sign(load.mean() - load))


def expert_load_summary(loads: torch.Tensor) -> torch.Tensor:
    """[min / mean, max / mean, std / mean] of the routing slots per expert, worst layer for each
    (the lowest min, the highest max and coefficient of variation): a step's three load numbers."""
    mean = loads.mean(dim=-1).clamp(min=1e-9)
    low = (loads.min(dim=-1).values / mean).min()
    high = (loads.max(dim=-1).values / mean).max()
    cv = (loads.std(dim=-1, correction=0) / mean).max()
    return torch.stack([low, high, cv])
