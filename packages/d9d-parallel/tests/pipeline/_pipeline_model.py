"""A tiny decoder in plain PyTorch that builds any pipeline stage, and a train loop to compare runs.

`StageModel(cfg, spec)` holds the embedding only on the first stage, the layers `spec.layers` (named
by their whole-model index) and the norm + head only on the last stage, so the union of all stages'
state dicts is the whole model's (`StageModel(cfg)`). `train(...)` trains either the whole model in
one process (the reference) or this rank's stages under a pipeline schedule (optionally FSDP over the
data axes), with the d9d loss contract: each microbatch's summed token loss divided by the global
batch's token count.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from d9d.mesh import DistributedContext, MeshConfig
from d9d.parallel import clip_grad_norm_, grad_norm, parallelize_fsdp, parallelize_hsdp, parallelize_replicate
from d9d.parallel.pipeline import Pipeline, PipelineConfig, StageSpec, keep_stage_layers, plan_pipeline

STEPS = 3
BATCH = 8
SEQ = 8
MAX_NORM = 0.5  # below the step-0 norm, so clipping (and so the global norm) changes the update


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 32
    dim: int = 16
    n_heads: int = 2
    hidden: int = 32
    n_layers: int = 4


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.attn_norm = RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            y.view(b, t, self.n_heads, -1).transpose(1, 2) for y in self.qkv(self.attn_norm(x)).chunk(3, -1)
        )
        # a position-dependent scale on q: the keyword input must reach every stage
        q = q * (1.0 + 0.1 * torch.cos(positions.to(x.dtype)))[None, None, :, None]
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class StageModel(nn.Module):
    """The whole model (`spec=None`) or one pipeline stage of it; implements `PipelineStageModule`."""

    def __init__(self, cfg: TinyConfig, spec: StageSpec | None = None) -> None:
        super().__init__()
        first = spec is None or spec.is_first
        last = spec is None or spec.is_last
        layers = range(cfg.n_layers) if spec is None else spec.layers
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim) if first else None
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in layers})
        self.norm = RMSNorm(cfg.dim) if last else None
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if last else None

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(inputs) if self.embed is not None else inputs
        for layer in self.layers.values():
            x = layer(x, positions)
        if self.head is not None and self.norm is not None:
            x = self.head(self.norm(x))
        return x


def full_state(cfg: TinyConfig) -> dict[str, torch.Tensor]:
    """The same whole-model weights on every call (every rank copies its stages' part)."""
    torch.manual_seed(0)
    model = StageModel(cfg)
    with torch.no_grad():  # non-trivial norm weights, so their gradients matter
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.add_(0.1 * torch.randn_like(module.weight))
    return model.state_dict()


def build_stage(cfg: TinyConfig, spec: StageSpec | None) -> StageModel:
    model = StageModel(cfg, spec)
    full = full_state(cfg)
    model.load_state_dict({k: full[k] for k in model.state_dict()})
    return model


def trimmed_on_meta(cfg: TinyConfig, spec: StageSpec) -> StageModel:
    """The stage as a model provider builds it: the whole model on meta, trimmed to the stage."""
    with torch.device("meta"):
        model = StageModel(cfg)
    keep_stage_layers(model.layers, spec)
    if not spec.is_first:
        model.embed = None
    if not spec.is_last:
        model.norm = model.head = None
    return model


def batches(cfg: TinyConfig) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, cfg.vocab_size, (STEPS, BATCH, SEQ + 1), generator=gen)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / (BATCH * SEQ)


def _optimizer(params: list[nn.Parameter], kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.5)


@dataclass
class RunResult:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def reference_run(optimizer: str = "sgd", cfg: TinyConfig | None = None) -> RunResult:
    """One process, whole model, the whole global batch in one forward."""
    cfg = cfg or TinyConfig()
    model = build_stage(cfg, None)
    opt = _optimizer(list(model.parameters()), optimizer)
    tokens = batches(cfg)
    positions = torch.arange(SEQ)
    losses, norms = [], []
    for step in range(STEPS):
        loss = loss_fn(model(tokens[step, :, :-1], positions), tokens[step, :, 1:])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return RunResult(losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()})


def pipeline_run(
    mesh: MeshConfig,
    pipeline: PipelineConfig,
    n_microbatches: int,
    *,
    optimizer: str = "sgd",
    data_parallel: str | None = None,
    reshard_after_forward: bool | None = None,
    meta_init: bool = False,
    cfg: TinyConfig | None = None,
) -> RunResult:
    """Inside a forked rank: build this rank's stages, train, return its losses, norms and parameters.

    `data_parallel`: None, "fsdp" (`parallelize_fsdp` over the data axes, blocks as their own groups),
    "hsdp" (`parallelize_hsdp`) or "replicate" (`parallelize_replicate`), each stage its own root.
    `meta_init`: build each stage as a trainer does (meta device, trim, parallelize, materialize, load).
    """
    cfg = cfg or TinyConfig()
    with DistributedContext.from_env(mesh) as ctx:
        dense = ctx.mesh("dense")
        layout = plan_pipeline(cfg.n_layers, ctx.axis_size("pp"), pipeline, n_microbatches=n_microbatches)
        modules = []
        for spec in layout.stages_of_rank(ctx.coordinate("pp")):
            module = trimmed_on_meta(cfg, spec) if meta_init else build_stage(cfg, spec)
            blocks = list(module.layers.values())
            if data_parallel == "fsdp":
                parallelize_fsdp(module, dense, blocks=blocks, reshard_after_forward=reshard_after_forward)
            elif data_parallel == "hsdp":
                parallelize_hsdp(module, dense, blocks=blocks, reshard_after_forward=reshard_after_forward)
            elif data_parallel == "replicate":
                parallelize_replicate(module, dense, blocks=blocks)
            if meta_init:  # materialize only this stage, then load its part of the whole model
                module.to_empty(device="cpu")
                full = full_state(cfg)
                options = StateDictOptions(full_state_dict=True)
                set_model_state_dict(module, {k: full[k] for k in module.state_dict()}, options=options)
            modules.append(module)
        pipe = Pipeline(layout, modules, pp_group=dense["pp"], n_microbatches=n_microbatches, loss_fn=loss_fn)
        params = [p for m in modules for p in m.parameters()]
        opt = _optimizer(params, optimizer)
        dp, dp_rank = ctx.axis_size("dp"), ctx.coordinate("dp")
        per_rank = BATCH // dp
        tokens = batches(cfg)
        positions = torch.arange(SEQ)
        losses, norms = [], []
        for step in range(STEPS):
            rows = tokens[step, dp_rank * per_rank : (dp_rank + 1) * per_rank]
            micro = list(rows.chunk(n_microbatches))
            loss = pipe.step(
                [m[:, :-1] for m in micro],
                [m[:, 1:] for m in micro],
                kwargs=[{"positions": positions}] * n_microbatches,
                broadcast_loss=True,
            )
            assert loss is not None
            if dp > 1:
                dist.all_reduce(loss, group=ctx.mesh("batch")["dp"].get_group())
            norm = grad_norm(params, pp_group=dense["pp"])
            clipped = clip_grad_norm_(params, MAX_NORM, pp_group=dense["pp"])
            torch.testing.assert_close(clipped, norm, rtol=0, atol=0)
            norms.append(float(norm))
            losses.append(float(loss))
            opt.step()
            opt.zero_grad()
        state = {}
        for module in modules:
            for name, value in module.state_dict().items():
                state[name] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        if data_parallel and not all(isinstance(p, DTensor) for p in params):
            raise AssertionError("every parameter of an FSDP stage must be a DTensor")
        return RunResult(losses, norms, state)


def assert_same_run(ranks: list[RunResult], want: RunResult, *, rtol: float, atol: float) -> None:
    """Every rank's losses and norms match the reference; the union of their stages' parameters too."""
    for got in ranks:
        torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=rtol, atol=atol)
        torch.testing.assert_close(
            torch.tensor(got.grad_norms), torch.tensor(want.grad_norms), rtol=rtol, atol=atol
        )
    seen: set[str] = set()
    for got in ranks:
        for name, value in got.params.items():
            seen.add(name)
            torch.testing.assert_close(
                value, want.params[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
            )
    assert seen == set(want.params), f"stages miss {set(want.params) - seen} or add {seen - set(want.params)}"


#: (schedule, stages per rank, microbatches): every schedule, single- and multi-stage.
SCHEDULE_CASES = [
    ("gpipe", 1, 4),
    ("1f1b", 1, 2),
    ("interleaved_1f1b", 2, 4),
    ("looped_bfs", 2, 4),
    ("interleaved_zero_bubble", 2, 4),
    ("zbv", 2, 4),
    ("dualpipev", 2, 4),
]
