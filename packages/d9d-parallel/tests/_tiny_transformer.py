"""A tiny decoder-only transformer in plain PyTorch, for parallelism tests and benchmarks.

Embedding, `n_layers` blocks of causal attention (rotary positions) + SwiGLU MLP with RMSNorm, a final norm and an LM
head. Shapes are read from local tensors (`view(b, t, -1, head_dim)`), so the same code runs with
heads split across tensor-parallel ranks.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from d9d.parallel import TensorParallelPlan, attention_plan, embedding_plan, lm_head_plan, mlp_plan, norm_plan


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 64
    dim: int = 32
    n_heads: int = 4
    hidden: int = 64
    n_layers: int = 2
    tie_embeddings: bool = False  # the LM head shares the embedding's table


def rotary_table(seq: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """(2, seq, head_dim / 2): cos and sin of the rotary angles, for the full sequence."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv_freq
    return torch.stack([angles.cos(), angles.sin()])


def _rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    cos, sin = rope[0].to(x.dtype), rope[1].to(x.dtype)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        q, k = _rotate(q, rope), _rotate(k, rope)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class TinyTransformer(nn.Module):
    def __init__(self, cfg: TinyConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or TinyConfig()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rope = rotary_table(tokens.shape[1], self.cfg.dim // self.cfg.n_heads, tokens.device)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, rope)
        return self.lm_head(self.norm(x))


def make_model(seed: int = 0, cfg: TinyConfig | None = None) -> TinyTransformer:
    """The same weights on every call with the same seed (every rank builds the full model)."""
    torch.manual_seed(seed)
    model = TinyTransformer(cfg)
    with torch.no_grad():  # non-trivial norm weights, so their gradients matter
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.add_(0.1 * torch.randn_like(module.weight))
    return model


def make_batches(steps: int, batch: int, seq: int, vocab: int = 64, seed: int = 1) -> torch.Tensor:
    """Token ids of shape (steps, batch, seq + 1): inputs are [..., :-1], targets [..., 1:]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (steps, batch, seq + 1), generator=gen)


def tiny_plan(sequence_parallel: bool = True, loss_parallel: bool = True) -> TensorParallelPlan:
    """The tensor-parallel plan of `TinyTransformer`, built from d9d.parallel's pieces."""
    sp = sequence_parallel
    return (
        embedding_plan("embed", sequence_parallel=sp)
        | attention_plan("blocks.*.attn", qkv=("q", "k", "v"), out="o", sequence_parallel=sp, extra_inputs=1)
        | mlp_plan("blocks.*.mlp", up=("gate", "up"), down="down", sequence_parallel=sp)
        | norm_plan("blocks.*.attn_norm", "blocks.*.mlp_norm", "norm", sequence_parallel=sp)
        | lm_head_plan("lm_head", sequence_parallel=sp, loss_parallel=loss_parallel)
    )
