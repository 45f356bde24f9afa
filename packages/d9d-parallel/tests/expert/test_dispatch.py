"""Token dispatch: the regrouping index, and all-to-all with uneven and zero-size splits on 2 ranks."""

import copy

import pytest
import torch

from d9d.mesh import D9dError, DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel.expert import (
    GroupedExperts,
    LocalDispatcher,
    MoE,
    expert_major_order,
    parallelize_expert_parallel,
)

HIDDEN, FFN, EXPERTS = 8, 6, 4


def test_expert_major_order_regroups_source_major_blocks():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # 2 sources × 3 experts
    # source-major rows: s0e0 s0e0 s0e2 | s1e0 s1e1 s1e1 s1e1
    labels = ["s0e0a", "s0e0b", "s0e2a", "s1e0a", "s1e1a", "s1e1b", "s1e1c"]
    order = expert_major_order(counts)
    assert [labels[i] for i in order.tolist()] == [
        "s0e0a",
        "s0e0b",
        "s1e0a",
        "s1e1a",
        "s1e1b",
        "s1e1c",
        "s0e2a",
    ]


def test_expert_major_order_of_nothing_is_empty():
    assert expert_major_order(torch.zeros(2, 2, dtype=torch.long)).numel() == 0


#: Tokens per global expert sent by rank 0 and rank 1. Case "zero_split": rank 1 sends nothing to
#: rank 0 and expert 1 gets no token at all; case "empty_rank": rank 0 has no token.
CASES = {
    "zero_split": [[3, 0, 2, 0], [0, 0, 4, 1]],
    "empty_rank": [[0, 0, 0, 0], [2, 1, 0, 3]],
    "one_sided": [[0, 0, 5, 2], [4, 0, 0, 0]],
}


def _tokens(counts: list[list[int]]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(sum(c), HIDDEN, generator=gen) for c in counts]


def _dispatch_on_rank(cases: dict[str, list[list[int]]]):
    ctx = DistributedContext.from_env(MeshConfig(data_parallel_shard=2, expert_parallel=2))
    results = {}
    for name, counts in cases.items():
        torch.manual_seed(0)
        moe = MoE(HIDDEN, FFN, EXPERTS, 1)
        parallelize_expert_parallel(moe, ctx, shard_expert_replicas=False)
        tokens = _tokens(counts)[ctx.rank].requires_grad_()
        out = moe.dispatcher(tokens, torch.tensor(counts[ctx.rank]), moe.experts)
        out_grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(ctx.rank))
        (out * out_grad).sum().backward()
        local_grads = {n: p.grad.to_local().clone() for n, p in moe.experts.named_parameters()}
        results[name] = (out.detach(), tokens.grad, local_grads)
    ctx.close()
    return results


def test_all_to_all_dispatch_with_uneven_and_zero_splits_matches_local_2ranks():
    torch.manual_seed(0)
    reference_experts = copy.deepcopy(MoE(HIDDEN, FFN, EXPERTS, 1).experts)
    results = run_distributed(_dispatch_on_rank, 2, CASES)
    for name, counts in CASES.items():
        experts = copy.deepcopy(reference_experts)
        for rank, tokens in enumerate(_tokens(counts)):
            tokens.requires_grad_()
            expected = LocalDispatcher()(tokens, torch.tensor(counts[rank]), experts)
            out_grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(rank))
            (expected * out_grad).sum().backward()  # weight grads accumulate over both ranks' tokens
            out, token_grad, _ = results[rank][name]
            torch.testing.assert_close(out, expected.detach(), msg=f"{name} rank {rank} output")
            torch.testing.assert_close(token_grad, tokens.grad, msg=f"{name} rank {rank} input grad")
        for rank in range(2):  # rank r owns experts [2r, 2r+2)
            for n, grad in results[rank][name][2].items():
                full_grad = dict(experts.named_parameters())[n].grad
                torch.testing.assert_close(grad, full_grad[2 * rank : 2 * rank + 2], msg=f"{name} {n}")


def _error_of(fn) -> str | None:
    try:
        fn()
    except D9dError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _bad_configs_on_rank() -> dict[str, str | None]:
    ep_ctx = DistributedContext.from_env(MeshConfig(data_parallel_shard=2, expert_parallel=2))
    tp_ctx = DistributedContext.from_env(MeshConfig(tensor_parallel=2, expert_parallel=2))
    twice = MoE(HIDDEN, FFN, EXPERTS, 1)
    parallelize_expert_parallel(twice, ep_ctx)
    return {
        "indivisible": _error_of(lambda: parallelize_expert_parallel(MoE(HIDDEN, FFN, 3, 1), ep_ctx)),
        "twice": _error_of(lambda: parallelize_expert_parallel(twice, ep_ctx)),
        "tensor_parallel": _error_of(lambda: parallelize_expert_parallel(MoE(HIDDEN, FFN, 4, 1), tp_ctx)),
    }


def test_bad_expert_parallel_configs_are_clear_errors_2ranks():
    for errors in run_distributed(_bad_configs_on_rank, 2):
        assert errors["indivisible"] is not None
        assert errors["indivisible"].startswith("ExpertParallelError")
        assert "num_experts=3" in errors["indivisible"] and "expert_parallel=2" in errors["indivisible"]
        assert errors["twice"] is not None and "already parallelized" in errors["twice"]
        assert errors["tensor_parallel"] is not None
        assert errors["tensor_parallel"].startswith("UnsupportedParallelismError")
        assert "not supported yet" in errors["tensor_parallel"]


@pytest.mark.parametrize("width", [HIDDEN, 20], ids=["grouped", "loop"])
def test_grouped_experts_reject_counts_that_do_not_cover_the_tokens(width):
    with pytest.raises(RuntimeError):
        GroupedExperts(2, width, width)(torch.randn(3, width), torch.tensor([1, 1]))
