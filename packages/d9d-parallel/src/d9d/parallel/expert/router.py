"""Top-k token router: which experts each token goes to, and with what weight; recording those
choices and replaying them in a later forward (RL: the experts sampling chose, in the training forward).

    with record_routing(model) as routing:      # per MoE layer, per forward: [tokens, top_k] experts
        model(prompt_ids)
    with replay_routing(model, [torch.cat(forwards) for forwards in routing]):
        loss = model(prompt_ids).sum()          # the same experts; weights from the current logits
        loss.backward()
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from d9d.parallel.expert.errors import ExpertParallelError

__all__ = ["RouterOutput", "TopKRouter", "record_routing", "replay_routing", "set_replayed_routing"]


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
        self.replay: torch.Tensor | None = None  # [T, k] experts to use (`set_replayed_routing`)
        self.record: list[torch.Tensor] | None = None  # each forward's [T, k] experts (`record_routing`)

    def reset_parameters(self) -> None:
        """A fresh score bias is zero (the gate is an `nn.Linear`, initialized as one)."""
        if self.score_bias is not None:
            with torch.no_grad():
                self.score_bias.zero_()

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """Route `x` of shape [T, hidden]."""
        logits = self.gate(x).float()
        probs = torch.softmax(logits, dim=-1)
        if self.score_bias is None and self.replay is None:
            weights, indices = torch.topk(probs, self.top_k, dim=-1)
        else:  # the bias (or the replay) picks the experts; the weights stay the probabilities
            scores = probs.detach() if self.score_bias is None else probs.detach() + self.score_bias
            indices = torch.topk(scores, self.top_k, dim=-1).indices
            if self.replay is not None:
                indices = self._replayed(indices)
            weights = probs.gather(-1, indices)
        if self.record is not None:
            self.record.append(indices.detach())
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return RouterOutput(weights=weights.to(x.dtype), indices=indices, probs=probs, logits=logits)

    def _replayed(self, chosen: torch.Tensor) -> torch.Tensor:
        """The replayed experts where given (a token's row of -1: its own top-k, `chosen`)."""
        given = self.replay
        assert given is not None
        if given.shape != chosen.shape:
            raise ExpertParallelError(
                f"replayed MoE routing has {given.shape[0]} tokens, this forward {chosen.shape[0]}: give each "
                "MoE layer the [tokens, top_k] experts of exactly this forward's tokens"
            )
        return torch.where(given[:, :1] >= 0, given, chosen)


def _routers(model: nn.Module) -> list[TopKRouter]:
    """The routers of `model`'s MoE layers, in module order (the order of `moe_layers`)."""
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


@contextmanager
def record_routing(model: nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Record the experts every MoE layer of `model` chooses: yields, per layer (module order), the
    [tokens, top_k] int64 indices of each forward in order (tokens flattened from the input's
    leading dims, on the device). An activation-checkpointing recompute would record again: record
    forwards without gradient (e.g. sampling)."""
    routers = _routers(model)
    records: list[list[torch.Tensor]] = [[] for _ in routers]
    before = [r.record for r in routers]
    for router, record in zip(routers, records, strict=True):
        router.record = record
    try:
        yield records
    finally:
        for router, previous in zip(routers, before, strict=True):
            router.record = previous


def set_replayed_routing(model: nn.Module, routing: Sequence[torch.Tensor] | None) -> None:
    """Make every MoE layer of `model` use the given experts (None: its own top-k again).

    `routing` holds one int64 tensor per MoE layer (module order), [..., top_k]: the experts of each
    token of the next forwards, tokens flattened from the leading dims in the order the layer sees
    them; a token whose experts are all -1 takes its own top-k. The weights are the current
    probabilities of the given experts (renormalized as configured), so gradients reach the gate as
    usual. It stays until set again, so an activation-checkpointing recompute in the backward
    replays it too; `replay_routing` scopes it. Pass host tensors: the check reads them.

    Raises:
        ExpertParallelError: a count of layers, a top_k or an expert id the model does not have.
    """
    routers = _routers(model)
    if routing is None:
        for router in routers:
            router.replay = None
        return
    if len(routing) != len(routers):
        raise ExpertParallelError(
            f"replayed MoE routing for {len(routing)} layers, the model has {len(routers)} MoE layers: give one "
            "[tokens, top_k] tensor per MoE layer, in module order"
        )
    checked = [
        _checked(i, router, given) for i, (router, given) in enumerate(zip(routers, routing, strict=True))
    ]
    for router, given in zip(routers, checked, strict=True):  # all checked first: none set on a refusal
        router.replay = given.to(router.gate.weight.device, non_blocking=True)


def _checked(layer: int, router: TopKRouter, given: torch.Tensor) -> torch.Tensor:
    """Layer `layer`'s replayed experts as [tokens, top_k], or an error naming what is wrong."""
    k, experts = router.top_k, router.num_experts
    fits = given.dtype == torch.int64 and given.shape[-1:] == (k,)
    flat = given.reshape(-1, k) if fits else given
    unset = flat == -1
    if not fits or bool(((flat < -1) | (flat >= experts)).any() | (unset.any(-1) != unset.all(-1)).any()):
        raise ExpertParallelError(
            f"replayed MoE routing of layer {layer} must be int64 [..., top_k={k}] expert ids in [0, {experts}) "
            f"(all -1 for a token: the router's own choice), got {given.dtype} {tuple(given.shape)}"
        )
    return flat


@contextmanager
def replay_routing(model: nn.Module, routing: Sequence[torch.Tensor]) -> Iterator[None]:
    """`set_replayed_routing` for the forwards (and backwards) inside the block, then the own top-k."""
    set_replayed_routing(model, routing)
    try:
        yield
    finally:
        set_replayed_routing(model, None)
