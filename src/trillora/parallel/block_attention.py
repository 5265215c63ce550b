"""Causal attention of query chunks against key blocks, merged by log-sum-exp, for context parallelism.

A context-parallel rank holds query chunks that sit in the middle of the sequence (zig-zag
layout), so its causal mask is neither "all" nor PyTorch's top-left `is_causal`. Passing that
mask as a dense [t, T] tensor makes SDPA fall back to a kernel that keeps the mask and the
scores: more memory per rank than the whole sequence costs one process with the flash kernel
(measured: 41 MiB vs 12 MiB at T = 4096). Instead each query chunk at global chunk index g
attends in two flash calls:

    keys [0, g·s)          every key visible      (no mask)
    keys [g·s, (g+1)·s)    the diagonal block     (square, so top-left causal is right)

and the two partial results are merged exactly: with lse_i = log Σ exp(scores) of part i,
lse = logaddexp(lse_1, lse_2) and out = Σ_i exp(lse_i - lse) · out_i. Backward calls the flash
backward per part with the *merged* out and lse (the softmax of the whole row is exp(s - lse),
and rowsum(dO·O) uses the whole row's output), so each part's dq, dk, dv are exact and add up.
This is the block algebra of ring attention, here over gathered keys.

Attention sinks (gpt-oss) are one more part: a zero output with lse_sink = sink_h. Merged in like the
others, out and lse become the whole row's with the sink in the denominator, so the same per-part
backward stays exact, and the sink's own gradient is -exp(sink - lse) · rowsum(dO·O).

CPU only: the kernels are `aten::_scaled_dot_product_flash_attention_for_cpu` and its backward.
Shape legend: B rows, H heads, t local queries, T keys (global order), D head dim, s chunk size.
"""

from __future__ import annotations

import torch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

# a query chunk: (its rows among the local queries, the key blocks it sees as (keys, causal))
Plan = list[tuple[slice, list[tuple[slice, bool]]]]


def zigzag_plan(chunk_ids: list[int], size: int) -> Plan:
    """The blocks for local query chunks at global chunk indices `chunk_ids`, each `size` tokens."""
    plan = []
    for j, g in enumerate(chunk_ids):
        parts = [(slice(0, g * size), False)] if g else []
        parts.append((slice(g * size, (g + 1) * size), True))
        plan.append((slice(j * size, (j + 1) * size), parts))
    return plan


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, K, T, D] -> [B, H, T, D]: each key/value head serves H/K query heads (GQA)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_heads(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The inverse of `_repeat_heads` for gradients: [B, H, T, D] -> [B, K, T, D]."""
    b, h, t, d = x.shape
    return x if h == kv_heads else x.view(b, kv_heads, h // kv_heads, t, d).sum(2)


class BlockCausalAttention(torch.autograd.Function):
    """softmax(q kᵀ·scale) v over the key blocks of `plan`; q [B, H, t, D], k and v [B, K, T, D].

    Keys and values are saved with their K heads and repeated to H only while computing, so
    grouped-query attention keeps K/H of the gathered K/V for backward."""

    @staticmethod
    def forward(ctx, q, k_kv, v_kv, sinks, plan: Plan, scale: float):
        q = q.contiguous()
        k, v = _repeat_heads(k_kv, q.shape[1]).contiguous(), _repeat_heads(v_kv, q.shape[1]).contiguous()
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:3])  # [B, H, t]
        for rows, parts in plan:
            o_run = l_run = None
            for keys, causal in parts:
                o, lse_part = _flash(q[:, :, rows], k[:, :, keys], v[:, :, keys], 0.0, causal, scale=scale)
                if o_run is None:
                    o_run, l_run = o, lse_part
                    continue
                merged = torch.logaddexp(l_run, lse_part)
                o_run = o_run * (l_run - merged).exp()[..., None] + o * (lse_part - merged).exp()[..., None]
                l_run = merged
            if sinks is not None:  # one more part: output 0, log-sum-exp sink_h
                merged = torch.logaddexp(l_run, sinks.to(l_run.dtype)[None, :, None])
                o_run, l_run = o_run * (l_run - merged).exp()[..., None], merged
            out[:, :, rows], lse[:, :, rows] = o_run, l_run
        ctx.save_for_backward(q, k_kv, v_kv, out, lse, sinks)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_kv, v_kv, out, lse, sinks = ctx.saved_tensors
        k, v = _repeat_heads(k_kv, q.shape[1]).contiguous(), _repeat_heads(v_kv, q.shape[1]).contiguous()
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows, parts in ctx.plan:
            args = (grad_out[:, :, rows].contiguous(), q[:, :, rows].contiguous())
            o, lse_rows = out[:, :, rows].contiguous(), lse[:, :, rows].contiguous()
            for keys, causal in parts:
                gq, gk, gv = _flash_backward(
                    *args,
                    k[:, :, keys].contiguous(),
                    v[:, :, keys].contiguous(),
                    o,
                    lse_rows,
                    0.0,
                    causal,
                    scale=ctx.scale,
                )
                dq[:, :, rows] += gq
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv
        d_sinks = None
        if sinks is not None and ctx.needs_input_grad[3]:  # -p_sink · rowsum(dO·O), summed over rows and queries
            d_sinks = -((sinks[None, :, None] - lse).exp() * (grad_out * out).sum(-1)).sum((0, 2)).to(sinks.dtype)
        return dq, _sum_heads(dk, k_kv.shape[1]), _sum_heads(dv, v_kv.shape[1]), d_sinks, None, None


def block_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, scale: float, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """q [B, H, t, D], k [B, K, T, D], v [B, K, T, V] in global key order, sinks [H] -> [B, t, H·V].

    Heads of different sizes (MLA: V ≠ D) are zero-padded to the wider for the kernel and cut after."""
    h, dv = q.shape[1], v.shape[-1]
    width = max(q.shape[-1], dv)  # the kernel wants one head size; zero columns change no score
    q, k, v = (torch.nn.functional.pad(x, (0, width - x.shape[-1])) for x in (q, k, v))
    out = BlockCausalAttention.apply(q, k, v, sinks, plan, scale)[..., :dv]  # [B, H, t, V]
    b, _, t, _ = out.shape
    return out.transpose(1, 2).reshape(b, t, h * dv)
