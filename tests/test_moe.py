"""Routers and stacked experts: grouped GEMM against the per-expert loop, routing by hand."""

from __future__ import annotations

import pytest
import torch
from hf_models import CONFIGS

from trillora.models import build_model, from_hf_config, set_grouped_gemm
from trillora.models.moe import ExpertSort, GroupedExperts, SigmoidRouter, dispatch_combine, grouped_linear
from trillora.rollout.routing import record_routing


def test_expert_sort_by_hand():
    idx = torch.tensor([[2, 0], [0, 1], [2, 1]])  # 3 tokens, top-2, 3 experts
    s = ExpertSort.build(idx, 3)
    assert s.counts.tolist() == [2, 2, 2]
    assert s.order.tolist() == [1, 2, 3, 5, 0, 4]  # stable: flat choices sorted by expert
    assert s.token.tolist() == [0, 1, 1, 2, 0, 2]


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 10, 0], [1, 1, 1, 1]])
def test_grouped_linear_equals_loop(counts):
    torch.manual_seed(0)
    counts_t = torch.tensor(counts)
    x = torch.randn(sum(counts), 16, requires_grad=True)
    w = torch.randn(4, 24, 16, requires_grad=True)
    y_g = grouped_linear(x, w, counts_t, grouped=True)
    gx, gw = torch.autograd.grad(y_g.square().sum(), (x, w))
    y_l = grouped_linear(x, w, counts_t, grouped=False)
    lx, lw = torch.autograd.grad(y_l.square().sum(), (x, w))
    assert (
        torch.allclose(y_g, y_l, atol=1e-5) and torch.allclose(gx, lx, atol=1e-4) and torch.allclose(gw, lw, atol=1e-4)
    )
    start = 0
    for e, c in enumerate(counts):  # and each block is that expert's product
        assert torch.allclose(y_g[start : start + c], x[start : start + c] @ w[e].T, atol=1e-5)
        start += c


def test_grouped_linear_slices_long_group_lists(monkeypatch):
    """More groups than one grouped GEMM takes (CUDA refuses over 1024: 8 adapters x 128 experts):
    slices of whole groups, each call within the limit, the same product and gradients as the loop."""
    import trillora.models.moe as moe

    calls, real = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda x, w, offs: calls.append(offs.shape[0]) or real(x, w, offs=offs))
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 3, (2 * moe.MAX_GROUPS + 37,), generator=g)
    x = torch.randn(int(counts.sum()), 8, generator=g, requires_grad=True)
    w = torch.randn(counts.shape[0], 8, 8, generator=g, requires_grad=True)
    y_g = grouped_linear(x, w, counts)
    gx, gw = torch.autograd.grad(y_g.square().sum(), (x, w))
    y_l = grouped_linear(x, w, counts, grouped=False)
    lx, lw = torch.autograd.grad(y_l.square().sum(), (x, w))
    assert calls == [moe.MAX_GROUPS, moe.MAX_GROUPS, 37]
    assert (
        torch.allclose(y_g, y_l, atol=1e-5) and torch.allclose(gx, lx, atol=1e-4) and torch.allclose(gw, lw, atol=1e-4)
    )


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss"])
def test_model_grouped_equals_loop_forward_and_grads(name):
    args = from_hf_config(CONFIGS[name])
    model = build_model(args, device="cpu")
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))

    def run(grouped: bool):
        set_grouped_gemm(model, grouped)
        model.zero_grad()
        logits = model(ids)
        logits.logsumexp(-1).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (lg, gg), (ll, gl) = run(True), run(False)
    assert torch.allclose(lg, ll, atol=1e-5)
    experts = [n for n in gg if ".experts." in n]
    assert experts  # the expert weights did get gradients
    for n in gg:
        assert torch.allclose(gg[n], gl[n], atol=1e-4, rtol=1e-4), n


def test_unaligned_shapes_fall_back_to_loop():
    e = GroupedExperts(3, dim=6, hidden=5)  # 6 and 5 floats are not 16-byte rows
    torch.nn.init.normal_(e.gate_up_proj)
    torch.nn.init.normal_(e.down_proj)
    x = torch.randn(4, 6)
    idx = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]])
    w = torch.rand(4, 2)
    ref = torch.zeros(4, 6)
    for t in range(4):
        for k in range(2):
            gate_up = e.gate_up_proj[idx[t, k]] @ x[t]
            h = torch.nn.functional.silu(gate_up[:5]) * gate_up[5:]
            ref[t] += w[t, k] * (e.down_proj[idx[t, k]] @ h)
    assert torch.allclose(dispatch_combine(e, x, idx, w), ref, atol=1e-5)


def test_sigmoid_router_group_limit_by_hand():
    args = from_hf_config(
        dict(CONFIGS["deepseek_v3"], n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=1)
    )
    r = SigmoidRouter(args)
    # make scores directly controllable: logits = x @ W.T with x = one-hot(0) -> logits = W[:, 0]
    with torch.no_grad():
        r.weight.zero_()
        r.weight[:, 0] = torch.tensor([0.0, 3.0, 2.0, 2.5, -1.0, 4.0, 1.0, 1.0])
        r.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -0.9, 0.0, 0.0]))
    x = torch.zeros(1, args.hidden_size)
    x[0, 0] = 1.0
    weights, idx = r(x)
    s = torch.sigmoid(torch.tensor([0.0, 3.0, 2.0, 2.5, -1.0, 4.0, 1.0, 1.0]))
    # group sums of top-2 (with bias): g0 = s0+s1, g1 = s2+s3, g2 = s4+s5-0.9, g3 = s6+s7 -> g1 wins
    assert sorted(idx[0].tolist()) == [2, 3]
    expect = torch.stack([s[2], s[3]]) / (s[2] + s[3]) * args.routed_scaling_factor
    got = weights[0][idx[0].argsort()]
    assert torch.allclose(got, expect, atol=1e-6)


def test_record_routing_shapes_and_replay_weights():
    args = from_hf_config(CONFIGS["qwen3_moe"])
    model = build_model(args, device="cpu")
    model.init_weights(std=0.1)
    ids = torch.randint(0, args.vocab_size, (2, 7))
    with record_routing(model) as rec:
        model(ids)
    assert sorted(rec) == [f"model.layers.{i}.mlp" for i in args.moe_layers]
    for calls in rec.values():
        assert len(calls) == 1 and calls[0].shape == (2, 7, args.top_k)
    model(ids)
    assert all(len(calls) == 1 for calls in rec.values())  # recording stops on exit: its hooks are gone
    moe = model.moe_layers()[0]
    x = torch.randn(5, args.hidden_size)
    w, idx = moe.gate(x)
    assert torch.allclose(moe.gate.weights_for(x, idx), w)


def test_an_expert_shard_without_rows_stays_in_the_graph():
    """Under expert parallelism a rank may receive no rows (a batch of identical prompts routes them
    all to the other rank's experts): its empty product must still carry gradients, or the backward
    all-to-all its peers wait in never runs."""
    x = torch.zeros(0, 4, requires_grad=True)
    w = torch.randn(3, 5, 4, requires_grad=True)
    y = grouped_linear(x, w, torch.zeros(3, dtype=torch.long))
    assert y.shape == (0, 5) and y.requires_grad
    y.sum().backward()
    assert x.grad.shape == (0, 4) and torch.equal(w.grad, torch.zeros_like(w))


def test_unaligned_rows_fall_back_to_the_loop_and_say_so_once():
    """A rank-6 adapter in fp32 makes 24-byte rows the grouped kernel refuses: the loop runs (the
    same product) and a warning names the shape, once."""
    import warnings

    x, w, counts = torch.randn(5, 6), torch.randn(3, 8, 6), torch.tensor([2, 0, 3])
    with pytest.warns(UserWarning, match="a 6-wide input or 8-wide output in torch.float32 is not"):
        y = grouped_linear(x, w, counts)
    assert torch.allclose(y, grouped_linear(x, w, counts, grouped=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grouped_linear(x, w, counts)  # the same shape again: silent
