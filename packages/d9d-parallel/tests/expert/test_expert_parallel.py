"""EP training equals one process: a small MoE transformer, 3 AdamW steps, over real gloo ranks.

Every layout is compared with a single-process run on the same global batch (computed in the pytest
process before forking): losses, gradient norms, step-0 gradients and final parameters. Each rank
takes its own slice of the global batch and normalises its loss by the global token count, so
gradients are summed over data-parallel ranks (the d9d contract).
"""

import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import grad_norm, parallelize_fsdp, parallelize_hsdp, parallelize_replicate
from d9d.parallel.expert import MoE, moe_aux_loss, parallelize_expert_parallel

VOCAB, HIDDEN, FFN, EXPERTS, TOP_K = 64, 32, 48, 4, 2
BATCH, SEQ, STEPS, LR, AUX_COEF = 8, 8, 3, 1e-3, 0.01


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.moe_norm = nn.RMSNorm(HIDDEN)
        self.moe = MoE(HIDDEN, FFN, EXPERTS, TOP_K, shared_ffn_size=16)

    def forward(self, x):
        q, k, v = self.qkv(self.attn_norm(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.moe(self.moe_norm(x))


class TinyMoELM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model() -> TinyMoELM:
    torch.manual_seed(0)
    return TinyMoELM()


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=gen)
    return data[..., :-1], data[..., 1:]


def step_loss(model, inputs, targets, global_tokens: int) -> torch.Tensor:
    logits = model(inputs)
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
    return ce / global_tokens + AUX_COEF * moe_aux_loss(model)


@dataclass
class Run:
    losses: list[float]
    grad_norms: list[float]
    first_grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    tokens_per_expert: list[list[int]] | None = None  # per block, last step (over the whole batch)


def tokens_per_expert(model) -> list[list[int]]:
    return [block.moe.last_stats.tokens_per_expert.tolist() for block in model.blocks]


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def reference_run() -> Run:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    inputs, targets = global_batch()
    run = Run([], [], {}, {})
    for step in range(STEPS):
        loss = step_loss(model, inputs[step], targets[step], inputs[step].numel())
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        run.losses.append(loss.item())
        run.grad_norms.append(math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values())))
        if step == 0:
            run.first_grads = grads
        opt.step()
        opt.zero_grad()
    run.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    run.tokens_per_expert = tokens_per_expert(model)
    return run


def distributed_run(config: MeshConfig, dense_dp: str, use_ctx: bool) -> Run:
    ctx = DistributedContext.from_env(config)
    model = make_model()
    parallelize_expert_parallel(model, ctx if use_ctx else ctx.mesh("expert"))
    if dense_dp == "fsdp":
        parallelize_fsdp(model, ctx.mesh("dense"), blocks=list(model.blocks))
    elif dense_dp == "hsdp":
        parallelize_hsdp(model, ctx.mesh("dense"), shard_axis="dp_shard", blocks=list(model.blocks))
    elif dense_dp == "replicate":
        parallelize_replicate(model, ctx.mesh("dense"))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    dp_group = ctx.mesh("batch")["dp"].get_group()
    dp, dp_rank = ctx.axis_size("dp"), ctx.coordinate("dp")
    inputs, targets = global_batch()
    per_rank = BATCH // dp
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    run = Run([], [], {}, {})
    for step in range(STEPS):
        loss = step_loss(model, inputs[step, rows], targets[step, rows], inputs[step].numel())
        loss.backward()
        if dense_dp == "allreduce":  # plain sum over dp for the dense (non-DTensor) parameters
            for p in model.parameters():
                if not isinstance(p, DTensor):
                    dist.all_reduce(p.grad, group=dp_group)
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_group)
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        norm_from_placements = float(grad_norm(model.parameters()))
        run.losses.append(total.item())
        run.grad_norms.append(math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values())))
        assert math.isclose(norm_from_placements, run.grad_norms[-1], rel_tol=1e-5)
        if step == 0:
            run.first_grads = grads
        opt.step()
        opt.zero_grad()
    run.params = {n: full(p) for n, p in model.named_parameters()}
    run.tokens_per_expert = tokens_per_expert(model)
    # Checkpointing reads the layout from the placements: experts are dim-0 shards on ep_shard.
    for p in model.blocks[0].moe.experts.parameters():
        assert p.device_mesh.mesh_dim_names[-1] == "ep_shard"
        assert p.placements[-1] == Shard(0)
    ctx.close()
    return run


@pytest.fixture(scope="module")
def reference() -> Run:
    return reference_run()


LAYOUTS = {
    "ep2_dp2_world2": (MeshConfig(data_parallel_replicate=2, expert_parallel=2), "allreduce", True),
    "ep2_ddp2_world2": (MeshConfig(data_parallel_replicate=2, expert_parallel=2), "replicate", True),
    "ep2_fsdp2_world2": (MeshConfig(data_parallel_shard=2, expert_parallel=2), "fsdp", True),
    "ep2_fsdp4_world4": (MeshConfig(data_parallel_shard=4, expert_parallel=2), "fsdp", False),
    # expert banks replicated over ep_replicate = 2: their gradient sum there is the banks' own, with
    # no dense data-parallel wrapper after it to reset their divide factor (a dropped sum fails here)
    "ep2_dp4_world4": (MeshConfig(data_parallel_replicate=4, expert_parallel=2), "allreduce", True),
    "ep2_hsdp2x2_world4": (
        MeshConfig(data_parallel_replicate=2, data_parallel_shard=2, expert_parallel=2),
        "hsdp",
        True,
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_matches_one_process(layout, reference):
    config, dense_dp, use_ctx = LAYOUTS[layout]
    runs = run_distributed(distributed_run, config.world_size, config, dense_dp, use_ctx)
    for run in runs:
        assert run.tokens_per_expert == reference.tokens_per_expert
        torch.testing.assert_close(run.losses, reference.losses, rtol=0, atol=1e-5)
        torch.testing.assert_close(run.grad_norms, reference.grad_norms, rtol=1e-5, atol=1e-6)
        assert run.first_grads.keys() == reference.first_grads.keys()
        for name, grad in reference.first_grads.items():
            torch.testing.assert_close(run.first_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
        for name, param in reference.params.items():
            torch.testing.assert_close(run.params[name], param, rtol=0, atol=1e-4, msg=name)
