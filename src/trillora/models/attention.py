"""Attention: grouped-query (Qwen3, GLM-4.5, gpt-oss) and multi-head latent (DeepSeek-V3 / Kimi K2).

Shape legend: B batch, T tokens, C hidden channels, H query heads, K key/value heads,
D head dim, L latent (kv_lora_rank), R rope dims, N nope dims, V value head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .args import ModelArgs
from .kv_cache import KVCache
from .layers import RMSNorm, apply_rope, local, yarn_mscale


def causal_mask(
    attention_mask: torch.Tensor | None, t: int, offset: int, device: torch.device, window: int = 0
) -> torch.Tensor | None:
    """Boolean mask [B, 1, t, S] (True = may attend) for t new queries after `offset` cached tokens,
    from a padding mask [B, S] over all S = offset + t tokens; None means plain causal, no cache.
    With a `window` each query sees only its last `window` keys (itself included).

    Each query may always see itself, so rows of padding stay finite instead of NaN.
    """
    if attention_mask is None and offset == 0 and (not window or window >= t):
        return None
    s = offset + t
    q_pos = torch.arange(offset, s, device=device)[:, None]
    k_pos = torch.arange(s, device=device)[None, :]
    mask = (k_pos <= q_pos)[None, None]  # [1, 1, t, S]
    if window:
        mask = mask & (k_pos > q_pos - window)[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, None, :]
    return mask | (k_pos == q_pos)[None, None]


def add_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention sinks (gpt-oss) as one extra key that every query sees: softmax over [scores, sink_h]
    with a zero value row, so the sink only takes probability mass away.

    The sink key must score sink_h for every query of head h, whatever q is. Each query gets G = H/K
    extra dims holding the one-hot of its place in its key/value group; keys get zeros there and the
    sink key holds sink_h / scale at its heads' places (zeros elsewhere). The scores of real keys are
    unchanged, the sink's is sink_h, gradients reach the sinks through an ordinary key, and the mask
    stays a boolean [.., T, S+1] shared by all heads, so SDPA keeps its fused kernels.
    """
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    g = h // kv
    place = torch.eye(g, dtype=q.dtype, device=q.device).repeat(kv, 1)  # [H, G]: head h -> e_{h mod G}
    q = torch.cat([q, place[None, :, None, :].expand(b, h, t, g)], dim=-1)  # [B, H, T, D+G]
    sink_key = F.pad((sinks.to(k.dtype) / scale).view(1, kv, 1, g), (d, 0)).expand(b, kv, 1, d + g)
    k = torch.cat([F.pad(k, (0, g)), sink_key], dim=2)  # [B, K, S+1, D+G]
    v = F.pad(v, (0, 0, 0, 1))  # [B, K, S+1, V]: the sink's value is zero
    if mask is None:  # plain causal over S = T keys
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)[None, None]
    mask = F.pad(mask, (0, 1), value=True)  # [B|1, 1, T, S+1]
    return q, k, v, mask


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    # q [B, H, T, D], k [B, K, S, D], v [B, K, S, V] -> [B, T, H*V]; sinks [H]
    if sinks is not None:
        q, k, v, mask = add_sinks(q, k, v, mask, sinks, scale)
    dv = v.shape[-1]
    if q.device.type == "cpu" and dv < q.shape[-1]:
        # MLA (V < D): the CPU flash kernel wants one head size, else SDPA falls back to a kernel that
        # keeps the [T, S] scores; zero columns of V leave the first V output columns unchanged
        v = F.pad(v, (0, q.shape[-1] - dv))
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None and q.shape[2] > 1,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )[..., :dv]
    b, h, t, d = out.shape
    return out.transpose(1, 2).reshape(b, t, h * d)


class InnerAttention(nn.Module):
    """softmax(q k^T) v after the projections, as its own module so that a parallel plan can
    swap it from outside (context parallelism attends to keys gathered from other ranks).
    `window` is the layer's sliding window (already in `mask` here; context parallelism, which
    builds its own mask, reads it)."""

    def __init__(self, window: int = 0):
        super().__init__()
        self.window = window

    def forward(
        self, q, k, v, mask: torch.Tensor | None, scale: float, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        return attend(q, k, v, mask, scale, sinks)


class GQAttention(nn.Module):
    """Grouped-query attention: per-head RMSNorm on q and k (Qwen3; optional in GLM-4.5), rope on
    the first `rotary_dim` dims of each head (all of them, or GLM's half); gpt-oss adds a learned
    sink logit per head and a sliding window on every other layer."""

    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        c, d, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.q_proj = nn.Linear(c, args.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(c, args.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(c, args.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(args.num_heads * d, c, bias=args.attention_out_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)
        if args.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(args.num_heads))
        self.rotary = args.rope_dim
        self.scale = d**-0.5
        self.inner = InnerAttention(args.window(layer))

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary == self.head_dim:
            return apply_rope(x, cos, sin)
        turned, kept = x.split([self.rotary, self.head_dim - self.rotary], dim=-1)  # [B, H, T, R], [B, H, T, D-R]
        return torch.cat([apply_rope(turned, cos, sin), kept], dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
        layer: int = 0,
    ):
        b, t, _ = x.shape
        # heads from the projections' widths (-1), so a tensor-parallel shard runs its own heads unchanged
        q = self.q_proj(x).view(b, t, -1, self.head_dim)  # [B, T, H, D]
        k = self.k_proj(x).view(b, t, -1, self.head_dim)  # [B, T, K, D]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, D], [B, K, T, D]
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        sinks = local(self.sinks) if hasattr(self, "sinks") else None
        return self.o_proj(self.inner(q, k, v, mask, self.scale, sinks))


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3, arXiv:2405.04434).

    Keys and values are expanded from a small latent (kv_lora_rank) plus one
    rope key shared by all heads; queries optionally go through their own
    low-rank bottleneck (q_lora_rank). Under YaRN the softmax scale gets the
    squared mscale correction of the reference implementation.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        c, h = args.hidden_size, args.num_heads
        self.num_heads = h
        self.nope, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.latent = args.kv_lora_rank
        self.interleaved = args.rope_interleave
        qk_dim = self.nope + self.rope_dim
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(c, h * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(c, args.q_lora_rank, bias=args.attention_bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank)
            self.q_b_proj = nn.Linear(args.q_lora_rank, h * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c, self.latent + self.rope_dim, bias=args.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.latent)
        self.kv_b_proj = nn.Linear(self.latent, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, c, bias=args.attention_bias)
        self.scale = qk_dim**-0.5
        if args.rope.kind == "yarn" and args.rope.mscale_all_dim:
            self.scale *= yarn_mscale(args.rope.factor, args.rope.mscale_all_dim) ** 2
        self.inner = InnerAttention()

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
        layer: int = 0,
    ):
        b, t, _ = x.shape
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, -1, self.nope + self.rope_dim).transpose(1, 2)  # [B, H, T, N+R]; H local under TP
        h = q.shape[1]
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)

        latent_rope = self.kv_a_proj_with_mqa(x)  # [B, T, L+R]
        latent, k_rope = latent_rope.split([self.latent, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [B, H, T, N], [B, H, T, V]

        cos, sin = rope
        q_rope = apply_rope(q_rope, cos, sin, self.interleaved)
        k_rope = apply_rope(k_rope.view(b, 1, t, self.rope_dim), cos, sin, self.interleaved)  # [B, 1, T, R]
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(b, h, t, self.rope_dim)], dim=-1)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        return self.o_proj(self.inner(q, k, v, mask, self.scale))
