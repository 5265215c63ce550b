"""`parallel.staged.StagedModel` on three gloo ranks (first, middle and last stage) against the whole
model in one process: logits of right-padded rows, LoRA gradients of a loss at arbitrary [N, K]
targets (the last stage's backward carried back through the others), and KV-cache sampling from
left-padded prompts on every stage, fp32 and on a bf16 base. Families: DeepSeek-V3 (MLA, a dense first layer) and
gpt-oss
(sliding windows on alternate layers, sinks, 4 layers over 3 stages)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
from hf_models import DEEPSEEK_V3, GPT_OSS

from trillora import lora
from trillora.models import build_model, from_hf_config
from trillora.models.transformer import OtherStage
from trillora.parallel.staged import StagedModel
from trillora.rollout.local import LocalEngine
from trillora.rollout.types import SamplingParams

FAMILIES = {"deepseek_v3": DEEPSEEK_V3, "gpt_oss": dict(GPT_OSS, sliding_window=4)}
RANKS = 3


def reference(family: str):
    args = from_hf_config(FAMILIES[family], where=family)
    model = build_model(args, device="cpu")
    model.init_weights(std=0.08, generator=torch.Generator().manual_seed(0))
    lora.apply_lora(
        model, lora.LoraConfig(rank=4, targets=("attention", "mlp", "shared_experts", "experts", "lm_head"))
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in lora.lora_parameters(model):
            p.normal_(0, 0.05, generator=g)
    return model


def target_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """What a Tinker loss reads: logprobs at [B, T, K] targets, weighted."""
    return -(torch.log_softmax(logits.float(), -1).gather(-1, targets) * weights).sum()


def check_family(family: str, rank: int) -> None:
    ref = reference(family)
    staged = StagedModel(copy.deepcopy(ref), dist.group.WORLD, rank, RANKS)
    assert len(staged.layers) >= 1 and staged.first == (rank == 0) and staged.last == (rank == RANKS - 1)
    assert isinstance(staged.lm_head, OtherStage) != staged.last
    data = torch.Generator().manual_seed(2)
    vocab = ref.args.vocab_size
    ids = torch.randint(0, vocab, (3, 9), generator=data)  # [B, T]
    targets = torch.randint(0, vocab, (3, 9, 2), generator=data)  # [B, T, K]
    weights = torch.rand(3, 9, 2, generator=data)

    # a pass with autograd: the loss on the last stage, its gradient carried back through the others
    want_logits = ref(ids)
    target_loss(want_logits, targets, weights).backward()
    logits = staged(ids)
    assert (logits is None) != staged.last
    loss = target_loss(logits, targets, weights) if staged.last else None
    if staged.last:
        torch.testing.assert_close(logits, want_logits)
    staged.backward(loss)
    want = dict(ref.named_parameters())
    grads = {n: p.grad for n, p in staged.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    assert any(".layers." in n for n in grads)  # every stage has layers with adapters
    for n, g in grads.items():
        torch.testing.assert_close(g, want[n].grad, msg=lambda m, n=n: f"rank {rank} {n}: {m}")

    # the same pass as row chunks in flight one after another (GPipe), 2 and 3 of them
    for chunks in (2, 3):
        for p in staged.parameters():
            p.grad = None
        staged.microbatches = chunks
        logits = staged(ids)
        assert len(staged._pass) == chunks
        if staged.last:
            torch.testing.assert_close(logits, want_logits)
        staged.backward(target_loss(logits, targets, weights) if staged.last else None)
        for n, p in staged.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(
                    p.grad, want[n].grad, msg=lambda m, n=n, chunks=chunks: f"rank {rank} chunks {chunks} {n}: {m}"
                )
    staged.microbatches = 1

    # decoding: every stage runs the same loop on the last stage's logits and picks the same tokens
    prompts = [[5, 9, 2, 7], [3, 1], [4, 4, 8, 6, 2, 1]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    with torch.no_grad(), staged.sharing_logits():
        assert staged(ids[:, :4], logits_to_keep=1).shape == (3, 1, vocab)
        got = LocalEngine.sharing(staged).generate(prompts, 2, params)
    wanted = LocalEngine.sharing(ref).generate(prompts, 2, params)
    same_samples(got, wanted)

    # a bf16 base: stages send bf16 hidden states, the last stage's logits reach the others in fp32
    ref, staged = ref.to(torch.bfloat16), copy.deepcopy(ref).to(torch.bfloat16)
    staged = StagedModel(staged, dist.group.WORLD, rank, RANKS)
    assert staged.hidden_dtype == torch.bfloat16
    with torch.no_grad(), staged.sharing_logits():
        got = LocalEngine.sharing(staged).generate(prompts, 2, params)
    same_samples(got, LocalEngine.sharing(ref).generate(prompts, 2, params))


def same_samples(got, wanted) -> None:
    for rows, want_rows in zip(got, wanted, strict=True):
        for c, w in zip(rows, want_rows, strict=True):
            assert c.token_ids == w.token_ids
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(w.logprobs))


def worker(rank: int, world: int) -> None:
    for family in FAMILIES:
        check_family(family, rank)


@pytest.mark.slow
def test_three_stages_compute_what_the_whole_model_computes():
    run_ranks(worker, RANKS)


@pytest.mark.slow
def test_the_pipeline_microbatches_benchmark_runs(tmp_path):
    """`benchmarks/pipeline_microbatches.py` (the README row's command, smaller): chunked passes
    through two stages, their gradients checked against the whole pass's before timing."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline_microbatches.py"
    out = tmp_path / "pm.json"
    subprocess.run(
        [
            sys.executable,
            str(script),
            "--rows",
            "4",
            "--tokens",
            "16",
            "--chunks",
            "1",
            "2",
            "--reps",
            "1",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    r = json.loads(out.read_text())
    assert set(r["seconds_best_of_reps"]) == {"1", "2"} and r["max_grad_rel_diff_vs_whole"] < 1e-4
