"""The one adapter optimizer path (`policy.optimizer`): hand-computed steps, a non-finite gradient
dropped, and two gloo ranks whose summed, clipped step equals one process on the summed gradient."""

from __future__ import annotations

import math

import pytest
import torch
from gloo_ranks import run_ranks
from torch import nn

from trillora.parallel.data_parallel import GradientSync
from trillora.policy import adamw, optimizer_step


def params_with_grads(values, grads) -> list[nn.Parameter]:
    out = []
    for v, g in zip(values, grads, strict=True):
        p = nn.Parameter(torch.tensor(v, dtype=torch.float32))
        p.grad = torch.tensor(g, dtype=torch.float32)
        out.append(p)
    return out


def test_a_clipped_adamw_step_by_hand():
    """Gradient [3, 4] | [0]: norm 5, clipped to 1. AdamW's first step moves each element by lr times
    m̂ / (sqrt(v̂) + eps) = lr · sign(g) whatever the clip (it scales m and sqrt(v) alike), so the
    step is -0.1 where the gradient is not 0; weight decay 0.5 first shrinks p by lr · wd = 5%."""
    ps = params_with_grads([[1.0, -2.0], [3.0]], [[3.0, 4.0], [0.0]])
    opt = adamw(ps, lr=0.1, weight_decay=0.5)
    out = optimizer_step(opt, ps, None, max_norm=1.0)
    assert out.stepped and out.norm == pytest.approx(5.0) and out.sent_bytes == 0
    torch.testing.assert_close(ps[0].detach(), torch.tensor([1.0 * 0.95 - 0.1, -2.0 * 0.95 - 0.1]))
    torch.testing.assert_close(ps[1].detach(), torch.tensor([3.0 * 0.95]))
    assert all(p.grad is None for p in ps)
    assert opt.state[ps[0]]["exp_avg"].tolist() == pytest.approx(
        [0.1 * 3 / 5, 0.1 * 4 / 5], rel=1e-5
    )  # (1-β1)·clipped g


def test_a_non_finite_gradient_never_reaches_the_adapter():
    ps = params_with_grads([[1.0, 2.0]], [[math.nan, 1.0]])
    opt = adamw(ps, lr=0.1)
    out = optimizer_step(opt, ps, None, max_norm=0.0)
    assert not out.stepped and math.isnan(out.norm)
    assert ps[0].detach().tolist() == [1.0, 2.0] and ps[0].grad is None and not opt.state


def _two_ranks(rank: int, world: int, results) -> None:
    # rank r holds gradient g_r; the sum is [4, 8] | [2] (norm sqrt(84)), clipped to 2
    grads = {0: ([1.0, 2.0], [0.5]), 1: ([3.0, 6.0], [1.5])}[rank]
    ps = params_with_grads([[1.0, 1.0], [1.0]], grads)
    sync = GradientSync([("a", ps[0]), ("b", ps[1])], set(), None, None, 2, 2)
    out = optimizer_step(adamw(ps, lr=0.01), ps, sync, max_norm=2.0)
    results[rank] = (out.norm, out.sent_bytes, [p.detach().tolist() for p in ps])


def test_two_ranks_step_as_one_process_on_the_summed_gradient():
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    run_ranks(_two_ranks, 2, results)
    one = params_with_grads([[1.0, 1.0], [1.0]], [[4.0, 8.0], [2.0]])
    want = optimizer_step(adamw(one, lr=0.01), one, None, max_norm=2.0)
    for rank in (0, 1):
        norm, sent, values = results[rank]
        assert norm == pytest.approx(want.norm) == pytest.approx(math.sqrt(84))
        assert sent == 3 * 4  # the three gradient floats, once
        for got, p in zip(values, one, strict=True):
            assert got == pytest.approx(p.detach().tolist(), abs=1e-7)
