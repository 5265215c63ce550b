"""`policy.logprobs.target_logprobs`: each datum's log p at its [N] or [N, K] targets, from whole
logits, from a context-parallel rank's positions, or from a vocabulary slice per tp rank; values
and gradients against log_softmax over the whole logits (2 gloo ranks for the split forms)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks

from trillora.parallel.context_parallel import ContextParallel
from trillora.policy.logprobs import target_logprobs


def test_logprobs_at_targets_by_hand():
    logits = torch.zeros(2, 2, 2)
    logits[:, 0, 1] = math.log(3.0)  # p = (1/4, 3/4) at position 0 of each row; (1/2, 1/2) at position 1
    one, two = target_logprobs(logits, [torch.tensor([1, 0]), torch.tensor([[0, 1]])])
    torch.testing.assert_close(one, torch.tensor([math.log(0.75), math.log(0.5)]))
    torch.testing.assert_close(two, torch.tensor([[math.log(0.25), math.log(0.75)]]))  # [N, K]: a shorter datum


def problem(seed: int = 0):
    """Logits [3, 7, 8] and three datums: 7 tokens [N], 5 tokens [N, 3], 2 tokens [N, 1]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 7, 8, generator=g)
    targets = [
        torch.randint(0, 8, (7,), generator=g),
        torch.randint(0, 8, (5, 3), generator=g),
        torch.randint(0, 8, (2, 1), generator=g),
    ]
    weights = [torch.randn(t.shape, generator=g) for t in targets]  # a loss that weighs every logprob differently
    return logits, targets, weights


def oracle(logits, targets, weights):
    logits = logits.clone().requires_grad_()
    logp = torch.log_softmax(logits, -1)
    outs = [logp[i, : t.shape[0]].gather(-1, t.reshape(t.shape[0], -1)).reshape(t.shape) for i, t in enumerate(targets)]
    sum((o * w).sum() for o, w in zip(outs, weights, strict=True)).backward()
    return outs, logits.grad


def test_whole_logits_equal_log_softmax():
    logits, targets, weights = problem()
    want, want_grad = oracle(logits, targets, weights)
    mine = logits.clone().requires_grad_()
    got = target_logprobs(mine, targets)
    sum((o * w).sum() for o, w in zip(got, weights, strict=True)).backward()
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(mine.grad, want_grad)


def worker(rank: int, world: int) -> None:
    logits, targets, weights = problem()
    want, want_grad = oracle(logits, targets, weights)

    cp = ContextParallel(dist.group.WORLD, rank, 2)
    padded = cp.set_length(logits.shape[1], logits.device)  # 7 tokens -> 8: chunks (r, 3 - r) of 2
    whole = torch.nn.functional.pad(logits, (0, 0, 0, padded - logits.shape[1]))
    local = whole[:, cp.query_positions].clone().requires_grad_()  # [3, 4, 8]: this rank's positions
    got = target_logprobs(local, targets, cp=cp)
    sum((o * w).sum() for o, w in zip(got, weights, strict=True)).backward()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)  # whole rows on every cp rank
    grad = torch.zeros_like(whole)
    grad[:, cp.query_positions] = local.grad
    dist.all_reduce(grad)  # each rank's positions' gradient, put together
    torch.testing.assert_close(grad[:, : logits.shape[1]], want_grad)

    part = logits.chunk(2, -1)[rank].clone().requires_grad_()  # [3, 7, 4]: this rank's vocabulary
    got = target_logprobs(part, targets, vocab_group=dist.group.WORLD)
    sum((o * w).sum() for o, w in zip(got, weights, strict=True)).backward()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(part.grad, want_grad.chunk(2, -1)[rank])


@pytest.mark.slow
def test_split_over_positions_or_vocabulary_equals_whole_logits():
    run_ranks(worker, 2)


@pytest.mark.slow
def test_the_long_datum_benchmark_runs(tmp_path):
    """`benchmarks/service_long_datum.py` (the README row's command, smaller): one datum's
    forward_backward on the service whole, under --cp 2 and with a vocabulary-parallel head; the
    same loss, and each split holding less at its peak than one process."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "service_long_datum.py"
    out = tmp_path / "long.json"
    run = subprocess.run(
        [
            sys.executable,
            str(script),
            "--seq-len",
            "512",
            "--vocab",
            "4096",
            "--layouts",
            "one process",
            "--cp 2",
            "--tp 2 --vocab-parallel",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["layout"]: r for r in json.loads(out.read_text())}
    one = rows["one process"]
    for name in ("--cp 2", "--tp 2 --vocab-parallel"):
        assert abs(rows[name]["loss"] - one["loss"]) < 1e-4 * abs(one["loss"])
        assert rows[name]["peak_bytes"] < 0.8 * one["peak_bytes"], (name, rows[name]["ratio"])
    assert out.with_suffix(".png").exists()
