"""Layers shared by the model families: RMSNorm, rotary embeddings (plain and YaRN), SwiGLU MLP.

Shape legend: B batch, T tokens (sequence), H heads, D head dim, C channels (hidden).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .args import RopeArgs


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor a parallel plan split (a DTensor: tp, ep or FSDP shards), else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 whatever the input dtype, as the reference implementations do."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SwiGLU(nn.Module):
    """The dense MLP of both families (also the shared experts of DeepSeek-V3)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1·m·ln(s) + 1 (1 when the context is not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(rope: RopeArgs, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the factor that scales cos/sin.

    YaRN blends interpolated (÷factor) and original frequencies with a linear ramp
    between the dimensions that rotate beta_fast and beta_slow times over the
    original context, so high frequencies stay untouched and low ones stretch.
    """
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    inv_freq = 1.0 / (rope.theta**exponents)  # [dim/2]
    if rope.kind == "default":
        return inv_freq, 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_original = 1 - ramp  # 1 for fast-rotating dims, 0 for slow ones
    inv_freq = inv_freq / rope.factor * ramp + inv_freq * keep_original

    if rope.attention_factor is not None:
        scale = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        scale = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    else:
        scale = yarn_mscale(rope.factor)
    return inv_freq, scale


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions; the buffer is recomputed, never loaded."""

    def __init__(self, rope: RopeArgs, dim: int):
        super().__init__()
        self.rope, self.dim = rope, dim
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.scale = 1.0
        self.reset_parameters()

    def reset_parameters(self) -> None:
        inv_freq, self.scale = rope_frequencies(self.rope, self.dim)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [B, T] -> cos, sin [B, T, dim]
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate x [B, H, T, D] by cos/sin [B, T, D].

    `interleaved` weights (DeepSeek-V3) pair dimensions (0,1), (2,3), ...; we
    de-interleave to the half-split layout first. Queries and keys get the same
    permutation, so attention scores are unchanged by it.
    """
    if interleaved:
        b, h, t, d = x.shape
        x = x.view(b, h, t, d // 2, 2).transpose(-1, -2).reshape(b, h, t, d)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin
