"""Train the tiny transformer in one process and under a parallel layout, on the same global batch.

Both runs use the d9d loss contract: every (micro)batch's summed token loss is divided by the token
count of the GLOBAL batch, and data-parallel gradients are summed.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tiny_transformer import TinyConfig, TinyTransformer, make_batches, make_model
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from d9d.mesh import DistributedContext, MeshConfig
from d9d.parallel import clip_grad_norm_, cross_entropy, loss_parallel, set_gradient_sync

STEPS = 3
BATCH = 8
SEQ = 8
LR = 1e-2
MAX_NORM = 1.0  # below the step-0 norm, so clipping changes the update


@dataclass
class RunResult:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return torch.optim.SGD(model.parameters(), lr=LR * 10)


#: Called with (model, optimizer) after each step's clipping, before `optimizer.step()`.
BetweenSteps = Callable[[nn.Module, torch.optim.Optimizer], None]


def reference_run(
    optimizer: str = "adamw", cfg: TinyConfig | None = None, *, between: BetweenSteps | None = None
) -> RunResult:
    """One process, full global batch, torch's own clip_grad_norm_."""
    cfg = cfg or TinyConfig()
    model = make_model(cfg=cfg)
    opt = _optimizer(model, optimizer)
    tokens = make_batches(STEPS, BATCH, SEQ, cfg.vocab_size)
    losses, norms = [], []
    for step in range(STEPS):
        inp, tgt = tokens[step, :, :-1], tokens[step, :, 1:]
        logits = model(inp)
        loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum") / tgt.numel()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(float(loss.detach()))
        if between is not None:
            between(model, opt)
        opt.step()
        opt.zero_grad()
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    initial = make_model(cfg=cfg).state_dict()
    # every parameter must have moved, or equality with the parallel run would prove little
    assert all(not torch.equal(v, initial[k]) for k, v in final.items())
    return RunResult(losses, norms, final)


def parallel_run(
    config: MeshConfig,
    parallelize: Callable[[nn.Module, DistributedContext], None],
    *,
    optimizer: str = "adamw",
    microbatches: int = 1,
    loss_scope: str = "global",
    meta_init: bool = False,
    cfg: TinyConfig | None = None,
    between: BetweenSteps | None = None,
) -> RunResult | None:
    """Run inside a forked rank: parallelize, train on this dp rank's slice; rank 0 returns the result.

    `loss_scope="global"` divides each microbatch loss by the global batch's tokens (the d9d contract,
    for summed gradients); "local" by this rank's tokens (for `gradient_reduction="mean"`).
    """
    cfg = cfg or TinyConfig()
    with DistributedContext.from_env(config) as ctx:
        if meta_init:
            with torch.device("meta"):
                model = TinyTransformer(cfg)
            parallelize(model, ctx)
            model.to_empty(device="cpu")
            full = make_model(cfg=cfg).state_dict()
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
        else:
            model = make_model(cfg=cfg)
            parallelize(model, ctx)
        opt = _optimizer(model, optimizer)
        tokens = make_batches(STEPS, BATCH, SEQ, cfg.vocab_size)
        dp, dp_rank = ctx.axis_size("dp"), ctx.coordinate("dp")
        per_rank = BATCH // dp
        dp_group = ctx.mesh("batch")["dp"].get_group() if dp > 1 else None
        divisor = BATCH * SEQ if loss_scope == "global" else per_rank * SEQ
        losses, norms = [], []
        for step in range(STEPS):
            rows = tokens[step, dp_rank * per_rank : (dp_rank + 1) * per_rank]
            step_loss = torch.zeros(())
            for i, micro in enumerate(rows.chunk(microbatches)):
                set_gradient_sync(model, i == microbatches - 1)
                inp, tgt = micro[:, :-1], micro[:, 1:]
                with loss_parallel():
                    loss = cross_entropy(model(inp), tgt, reduction="sum") / divisor
                    loss.backward()
                step_loss += loss.detach()
            if dp_group is not None:
                dist.all_reduce(step_loss, group=dp_group)
            if loss_scope == "local":
                step_loss /= dp
            norms.append(float(clip_grad_norm_(model.parameters(), MAX_NORM)))
            losses.append(float(step_loss))
            if between is not None:
                between(model, opt)
            opt.step()
            opt.zero_grad()
        params = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()
        }
        all_dtensor = all(isinstance(p, DTensor) for p in model.parameters())
        if not all_dtensor:
            raise AssertionError("every parameter of a distributed model must be a DTensor")
        return RunResult(losses, norms, params) if ctx.rank == 0 else None


def assert_same_run(got: RunResult, want: RunResult, *, rtol: float, atol: float) -> None:
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=rtol, atol=atol)
    torch.testing.assert_close(
        torch.tensor(got.grad_norms), torch.tensor(want.grad_norms), rtol=rtol, atol=atol
    )
    assert got.params.keys() == want.params.keys()
    for name, value in want.params.items():
        torch.testing.assert_close(
            got.params[name], value, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


def reference_and_parallel_run(
    config: MeshConfig,
    parallelize: Callable[[nn.Module, DistributedContext], None],
    *,
    optimizer: str = "adamw",
    microbatches: int = 1,
    loss_scope: str = "global",
    meta_init: bool = False,
    cfg: TinyConfig | None = None,
) -> tuple[RunResult, RunResult] | None:
    """Inside a forked rank: rank 0 first trains the one-process reference, then all ranks train."""
    reference = reference_run(optimizer, cfg) if dist.get_rank() == 0 else None
    got = parallel_run(
        config,
        parallelize,
        optimizer=optimizer,
        microbatches=microbatches,
        loss_scope=loss_scope,
        meta_init=meta_init,
        cfg=cfg,
    )
    return (reference, got) if reference is not None and got is not None else None
