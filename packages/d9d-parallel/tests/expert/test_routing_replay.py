"""Recording an MoE model's routing and replaying it: the replayed forward uses exactly the recorded
experts with the current probabilities as weights (gradients reach the gate), an activation-checkpointing
recompute replays them too, expert parallelism 2 replays as one process does, bad routing is one line."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel.expert import (
    ExpertParallelError,
    MoE,
    parallelize_expert_parallel,
    record_routing,
    replay_routing,
    set_replayed_routing,
)

VOCAB, HIDDEN, EXPERTS, TOP_K, BATCH, SEQ = 32, 16, 4, 2, 4, 6


class TinyMoE(nn.Module):
    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.moes = nn.ModuleList([MoE(HIDDEN, 24, EXPERTS, TOP_K) for _ in range(2)])
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if bias:  # a score bias: the pick and the weights differ
            for moe in self.moes:
                moe.router.score_bias = torch.tensor([0.3, -0.2, 0.1, 0.0])

    def forward(self, tokens: torch.Tensor, checkpointed: bool = False) -> torch.Tensor:
        x = self.embed(tokens)
        for moe in self.moes:
            x = x + (checkpoint(moe, x, use_reentrant=False) if checkpointed else moe(x))
        return self.head(x)


def _model(seed: int = 0, bias: bool = False) -> TinyMoE:
    torch.manual_seed(seed)
    return TinyMoE(bias)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _loss(model: TinyMoE, tokens: torch.Tensor, checkpointed: bool = False) -> torch.Tensor:
    logits = model(tokens, checkpointed)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="sum")


def _recorded(model: nn.Module, tokens: torch.Tensor, **kwargs) -> list[torch.Tensor]:
    """Each MoE layer's experts of one forward, [tokens, top_k]."""
    with torch.no_grad(), record_routing(model) as routing:
        model(tokens, **kwargs)
    assert all(len(forwards) == 1 for forwards in routing)
    return [forwards[0] for forwards in routing]


def _other_routing() -> list[torch.Tensor]:
    """The routing another model (other weights) chooses for the tokens: not `_model()`'s own."""
    return _recorded(_model(seed=5), _tokens())


def test_recording_gives_each_layers_top_k_per_forward_in_order():
    model, tokens = _model(), _tokens()
    with torch.no_grad(), record_routing(model) as routing:
        model(tokens)
        model(tokens[:, :2])
    assert [[tuple(f.shape) for f in forwards] for forwards in routing] == [
        [(BATCH * SEQ, 2), (BATCH * 2, 2)]
    ] * 2
    hidden = model.embed(tokens).reshape(-1, HIDDEN)
    expected = model.moes[0].router(hidden).indices
    assert torch.equal(routing[0][0], expected)
    assert model.moes[0].router.record is None  # recording ends with the block


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "score-bias"])
def test_replay_uses_the_given_experts_with_the_current_probabilities_as_weights(bias):
    model, tokens = _model(bias=bias), _tokens()
    given = _other_routing()
    own = _recorded(model, tokens)
    assert sum(int((a != b).any(-1).sum()) for a, b in zip(own, given, strict=True)) > 0  # they differ
    with replay_routing(model, given):
        replayed = _recorded(model, tokens)
        hidden = model.embed(tokens).reshape(-1, HIDDEN)
        route = model.moes[0].router(hidden)
    assert all(torch.equal(r, g) for r, g in zip(replayed, given, strict=True))  # count mismatches: 0
    picked = route.probs.gather(-1, given[0])
    torch.testing.assert_close(route.weights, picked / picked.sum(-1, keepdim=True))
    assert _recorded(model, tokens)[0].equal(own[0])  # after the block: its own top-k again


def test_replaying_its_own_routing_changes_nothing_and_gradients_reach_the_gate():
    model, tokens = _model(bias=True), _tokens()
    loss = _loss(model, tokens)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    own = _recorded(model, tokens)
    model.zero_grad()
    with replay_routing(model, own):
        replayed = _loss(model, tokens)
        replayed.backward()
    assert torch.equal(replayed, loss)
    for name, grad in grads.items():
        assert torch.equal(model.get_parameter(name).grad, grad), name
    assert float(model.moes[0].router.gate.weight.grad.abs().sum()) > 0


def test_minus_one_takes_the_routers_own_choice():
    model, tokens = _model(), _tokens()
    own, given = _recorded(model, tokens), _other_routing()
    mixed = [g.clone() for g in given]
    for m in mixed:
        m[::2] = -1  # every other token: not given
    with replay_routing(model, mixed):
        replayed = _recorded(model, tokens)
    for r, g, o in zip(replayed, given, own, strict=True):
        assert torch.equal(r[1::2], g[1::2]) and torch.equal(r[::2], o[::2])


def test_a_checkpointed_recompute_in_the_backward_replays_too():
    """Set before the forward, kept through the backward: the recompute routes the same tokens to the
    same experts, so the gradients are those without checkpointing."""
    model, tokens, given = _model(), _tokens(), _other_routing()
    with replay_routing(model, given):
        _loss(model, tokens).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with replay_routing(model, given):
        _loss(model, tokens, checkpointed=True).backward()
    for name, grad in plain.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("routing", "message"),
    [
        (lambda r: r[:1], r"for 1 layers, the model has 2 MoE layers"),
        (lambda r: [x[:, :1] for x in r], r"layer 0 must be int64 \[\.\.\., top_k=2\]"),
        (lambda r: [x.int() for x in r], r"layer 0 must be int64"),
        (lambda r: [r[0], r[1] + EXPERTS], r"layer 1 .* expert ids in \[0, 4\)"),
        (
            lambda r: [r[0], torch.cat([r[1][:1, :1], torch.full((1, 1), -1)], 1)],
            r"layer 1 .*all -1 for a token",
        ),
    ],
    ids=["layers", "top-k", "dtype", "expert-id", "half-given"],
)
def test_bad_routing_is_one_line(routing, message):
    model = _model()
    with pytest.raises(ExpertParallelError, match=message) as caught:
        set_replayed_routing(model, routing(_other_routing()))
    assert "\n" not in str(caught.value)
    assert all(m.router.replay is None for m in model.moes)  # nothing set by a refused routing


def test_routing_of_other_tokens_is_refused_in_the_forward():
    model, tokens = _model(), _tokens()
    with (
        replay_routing(model, _other_routing()),
        pytest.raises(ExpertParallelError, match="has 24 tokens, this forward 12"),
    ):
        model(tokens[:2])


# ---------------------------------------------------------------------------------- expert parallel 2


def _ep2_rank(routing: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    ctx = DistributedContext.from_env(MeshConfig(data_parallel_replicate=2, expert_parallel=2))
    model = _model()
    parallelize_expert_parallel(model, ctx)
    rank, rows = ctx.coordinate("dp"), BATCH // 2
    mine = slice(rank * rows * SEQ, (rank + 1) * rows * SEQ)  # this rank's rows, flattened
    tokens = _tokens()[rank * rows : (rank + 1) * rows]
    with replay_routing(model, [r[mine] for r in routing]), record_routing(model) as chosen:
        (_loss(model, tokens) / (BATCH * (SEQ - 1))).backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if isinstance(grad, DTensor):  # the experts: sharded over ep, summed there by the dispatch
            grad = grad.full_tensor()
        else:
            dist.all_reduce(grad)
        grads[name] = grad.detach().clone()
    ctx.close()
    return [forwards[0] for forwards in chosen], grads


def test_expert_parallel_2_replays_as_one_process():
    routing = _other_routing()
    model = _model()
    with replay_routing(model, routing), record_routing(model) as chosen:
        (_loss(model, _tokens()) / (BATCH * (SEQ - 1))).backward()
    ranks = run_distributed(_ep2_rank, 2, routing)
    for layer, expected in enumerate(routing):
        assert torch.equal(chosen[layer][0], expected)
        assert torch.equal(torch.cat([r[0][layer] for r in ranks]), expected)  # each rank: its rows' experts
    for name, p in model.named_parameters():
        for _, grads in ranks:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
