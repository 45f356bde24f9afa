"""Rotary position embeddings (RoPE): the inverse frequencies with their long-context scalings, the
cos/sin tables, and the rotation of queries and keys (half-split layout, HF's `rotate_half`)."""

import math

import torch
from torch import nn

from d9d.trainer.models.config import LinearRopeScaling, Llama3RopeScaling, RopeScaling, YarnRopeScaling

__all__ = ["RotaryEmbedding", "apply_rotary", "rope_attention_factor", "rope_inverse_frequencies"]


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The head_dim/2 inverse frequencies of RoPE (float32), scaled for long contexts as transformers does.

    With d = head_dim and i = 0 … d/2−1, plain RoPE has ω_i = θ^(−2i/d) (wavelength λ_i = 2π/ω_i).
    A scaling with factor s and pretraining length L changes them:

    - linear: ω_i / s.
    - llama3 (low l, high h): ω_i / s where λ_i > L/l; ω_i where λ_i < L/h; in between
      (1−γ)·ω_i/s + γ·ω_i with γ = (L/λ_i − l) / (h − l).
    - yarn (β_fast, β_slow): a dimension pair that turns r times over L positions has index
      c(r) = d·ln(L / (2πr)) / (2·ln θ); lo = c(β_fast), hi = c(β_slow) (floor / ceil when `truncate`),
      clipped to [0, d−1] (hi += 0.001 if lo = hi). With ramp_i = clip((i − lo) / (hi − lo), 0, 1) and
      e_i = 1 − ramp_i: ω'_i = (θ^(2i/d)·s)^(−1)·(1 − e_i) + ω_i·e_i, so fast dimensions (i < lo) keep
      ω_i and slow ones (i > hi) are interpolated.

    Every float32 operation is the one transformers 5 (`modeling_rope_utils`) does, in its order, so
    the frequencies are bitwise equal to its own; the cos/sin scale of yarn is `rope_attention_factor`.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    powers = theta**exponents
    inv_freq = 1.0 / powers
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):
        return inv_freq / scaling.factor
    if isinstance(scaling, Llama3RopeScaling):
        length, factor = scaling.original_max_position_embeddings, scaling.factor
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > length / low, inv_freq / factor, inv_freq)
        gamma = (length / wavelength - low) / (high - low)
        smoothed = (1 - gamma) * inv_freq / factor + gamma * inv_freq
        between = ~(wavelength < length / high) & ~(wavelength > length / low)
        return torch.where(between, smoothed, scaled)
    assert isinstance(scaling, YarnRopeScaling)
    length = scaling.original_max_position_embeddings

    def index(rotations: float) -> float:
        return (head_dim * math.log(length / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = index(scaling.beta_fast), index(scaling.beta_slow)
    if scaling.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    kept = 1 - ramp.to(device)
    return 1.0 / (scaling.factor * powers) * (1 - kept) + inv_freq * kept


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """The scale of the cos/sin tables: 1, except for yarn.

    Yarn: `attention_factor` when given; else m(s, mscale) / m(s, mscale_all_dim) when both are set
    (and non-zero), else m(s, 1), with m(s, μ) = 0.1·μ·ln(s) + 1 (1 when s ≤ 1), as transformers does.
    """
    if not isinstance(scaling, YarnRopeScaling):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def m(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(m(scaling.factor, scaling.mscale) / m(scaling.factor, scaling.mscale_all_dim))
    return m(scaling.factor)


class RotaryEmbedding(nn.Module):
    """Cos/sin tables of RoPE for given positions, in the half-split layout (HF's `rotate_half`).

    Channel i of a head is paired with channel i + head_dim/2, both rotated by the angle
    `position × ω_i` (`rope_inverse_frequencies`); yarn also scales both tables (`rope_attention_factor`).
    The inverse frequencies are a non-persistent float32 buffer (not in the state dict);
    `reset_buffers()` recomputes them after `to_empty`.
    """

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.attention_factor = rope_attention_factor(scaling)
        self.register_buffer("inv_freq", torch.empty(head_dim // 2, dtype=torch.float32), persistent=False)
        if not self.inv_freq.is_meta:  # meta arithmetic would import torch._dynamo; to_empty + reset follows
            self.reset_buffers()

    def _frequencies(self, device: torch.device) -> torch.Tensor:
        return rope_inverse_frequencies(self.head_dim, self.theta, self.scaling, device)

    def reset_buffers(self) -> None:
        """Recompute the inverse frequencies in float32 on the buffer's device."""
        self.inv_freq = self._frequencies(self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`position_ids` [batch, seq] → (cos, sin), each [batch, seq, head_dim] in `dtype`."""
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:  # the model was cast; angles must stay accurate
            inv_freq = self._frequencies(inv_freq.device)
        angles = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [batch, heads, seq, head_dim] by RoPE tables [batch, seq, head_dim] (half-split pairs)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return x * cos + rotated_half * sin
