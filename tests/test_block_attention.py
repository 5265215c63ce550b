"""Block-causal attention (context parallelism's CPU kernel path) against plain causal SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trillora.parallel.block_attention import block_causal_attention, zigzag_plan
from trillora.parallel.context_parallel import local_positions


def test_zigzag_plan_by_hand():
    # cp = 2, 8 tokens, chunk size 2: rank 0 holds global chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_plan([0, 3], 2) == [
        (slice(0, 2), [(slice(0, 2), True)]),
        (slice(2, 4), [(slice(0, 6), False), (slice(6, 8), True)]),
    ]
    assert zigzag_plan([1, 2], 2) == [
        (slice(0, 2), [(slice(0, 2), False), (slice(2, 4), True)]),
        (slice(2, 4), [(slice(0, 4), False), (slice(4, 6), True)]),
    ]


@pytest.mark.parametrize("heads,kv_heads,d,dv", [(4, 2, 16, 16), (4, 4, 24, 16)], ids=["gqa", "mla-shaped"])
@pytest.mark.parametrize("cp", [2, 3])
def test_each_rank_matches_full_causal_attention(heads, kv_heads, d, dv, cp):
    """Every rank's rows of output and its share of dq, dk, dv equal full causal attention's."""
    g = torch.Generator().manual_seed(0)
    b, t = 2, 12 * cp
    q = torch.randn(b, heads, t, d, generator=g, requires_grad=True)
    k = torch.randn(b, kv_heads, t, d, generator=g, requires_grad=True)
    v = torch.randn(b, kv_heads, t, dv, generator=g, requires_grad=True)
    grad = torch.randn(b, t, heads * dv, generator=g)
    scale = 0.3
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=kv_heads != heads)
    ref = ref.transpose(1, 2).reshape(b, t, heads * dv)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    dq, dk, dv_sum = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        pos = local_positions(t, cp, rank)
        q_local = q.detach()[:, :, pos].requires_grad_()
        k_all, v_all = k.detach().requires_grad_(), v.detach().requires_grad_()
        out = block_causal_attention(
            q_local, k_all, v_all, zigzag_plan([rank, 2 * cp - 1 - rank], t // (2 * cp)), scale
        )
        torch.testing.assert_close(out, ref[:, pos], rtol=1e-5, atol=1e-5)
        gq, gk, gv = torch.autograd.grad(out, (q_local, k_all, v_all), grad[:, pos])
        dq[:, :, pos] += gq
        dk += gk  # what the all-gather's backward (reduce-scatter) sums over ranks
        dv_sum += gv
    for got, want in zip((dq, dk, dv_sum), ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cp", [2, 3])
def test_sinks_are_one_more_merged_part(cp):
    """gpt-oss's sinks in the block path: output and dq, dk, dv, d_sinks equal attention whose softmax
    has sink_h in every row's denominator, written out in full (scores, masked, softmax with the sink)."""
    from trillora.models.attention import attend

    g = torch.Generator().manual_seed(1)
    b, heads, kv_heads, d, t = 2, 4, 2, 16, 8 * cp
    q = torch.randn(b, heads, t, d, generator=g, requires_grad=True)
    k = torch.randn(b, kv_heads, t, d, generator=g, requires_grad=True)
    v = torch.randn(b, kv_heads, t, d, generator=g, requires_grad=True)
    sinks = (torch.randn(heads, generator=g) * 2).requires_grad_()
    grad = torch.randn(b, t, heads * d, generator=g)
    scale = 0.25
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * scale  # [B, H, T, T]
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    probs = torch.cat([scores, sinks[None, :, None, None].expand(b, heads, t, 1)], -1).softmax(-1)[..., :-1]
    ref = (probs @ v.repeat_interleave(2, 1)).transpose(1, 2).reshape(b, t, heads * d)
    ref_grads = torch.autograd.grad(ref, (q, k, v, sinks), grad)
    # the single-process path (SDPA with the sink as an extra key) against the same reference
    single = attend(q, k, v, None, scale, sinks)
    torch.testing.assert_close(single, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(torch.autograd.grad(single, (q, k, v, sinks), grad), ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    total = [torch.zeros_like(x) for x in (q, k, v, sinks)]
    for rank in range(cp):
        pos = local_positions(t, cp, rank)
        q_local = q.detach()[:, :, pos].requires_grad_()
        k_all, v_all, s = k.detach().requires_grad_(), v.detach().requires_grad_(), sinks.detach().requires_grad_()
        out = block_causal_attention(
            q_local, k_all, v_all, zigzag_plan([rank, 2 * cp - 1 - rank], t // (2 * cp)), scale, s
        )
        torch.testing.assert_close(out, ref[:, pos], rtol=1e-5, atol=1e-5)
        gq, gk, gv, gs = torch.autograd.grad(out, (q_local, k_all, v_all, s), grad[:, pos])
        total[0][:, :, pos] += gq
        for acc, part in zip(total[1:], (gk, gv, gs), strict=True):
            acc += part
    for got, want in zip(total, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
