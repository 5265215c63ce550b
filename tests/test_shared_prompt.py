"""Each group's prompt run once in the training passes: the same logprobs, entropies and LoRA
gradients as the whole-row forward, on both model families; and the trainer's update through it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import build_batch
from hf_models import CONFIGS

from trillora import lora, rl
from trillora.config import load_config
from trillora.models import build_model, from_hf_config
from trillora.policy.logprobs import shared_prompt_logprobs, token_logprobs
from trillora.trainer import Trainer


def _model(name):
    model = build_model(from_hf_config(CONFIGS[name]), device="cpu")
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    lora.apply_lora(model, lora.LoraConfig(rank=4, targets=("attention", "mlp", "shared_experts", "experts")))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in lora.lora_parameters(model):
            p.normal_(0.0, 0.1, generator=g)  # non-zero B: a wrong prompt key shows in the LoRA gradients
    return model


def _batch(vocab, group=4, longest=6):
    g = torch.Generator().manual_seed(2)
    prompts = [[1, 5, 6, 7, 8], [1, 9], [1, 10, 11, 12]]  # different lengths: left-padded prompt keys
    rows = [p for p in prompts for _ in range(group)]
    completions = [
        torch.randint(3, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(1, longest + 1, (len(rows),), generator=g)
    ]
    return build_batch(rows, completions, [[0.0] * len(c) for c in completions])


@pytest.mark.parametrize("name,longest", [("qwen3_moe", 6), ("deepseek_v3", 6), ("qwen3_moe", 1)])
def test_shared_prompt_equals_whole_rows(name, longest):
    model = _model(name)
    batch = _batch(CONFIGS[name]["vocab_size"], longest=longest)
    mask = batch.completion_mask
    clen = mask.sum(-1).long()
    params = [p for _, p in lora.lora_parameters(model)]

    def run(fn):
        logp, ent = fn()
        loss = (logp * mask).sum() + 0.1 * (ent * mask).sum()
        return logp.detach(), ent.detach(), torch.autograd.grad(loss, params)

    whole = run(lambda: token_logprobs(model, batch.input_ids, 0.7, with_entropy=True))
    shared = run(
        lambda: shared_prompt_logprobs(model, batch.input_ids, batch.prompt_lengths, clen, 4, 0.7, with_entropy=True)
    )
    on = mask.bool()
    assert (whole[0] - shared[0])[on].abs().max() <= 1e-5
    assert (whole[1] - shared[1])[on].abs().max() <= 1e-5
    for gw, gs in zip(whole[2], shared[2], strict=True):
        assert gw.abs().max() > 0
        assert (gs - gw).abs().max() <= 1e-4 * gw.abs().max()  # summation order only
    before = torch.arange(mask.shape[1])[None] < (batch.prompt_lengths[:, None] - 1)
    assert torch.all(shared[0][before] == 0)  # prompt positions carry nothing


def test_rows_of_a_group_must_share_their_prompt():
    model = _model("qwen3_moe")
    batch = _batch(CONFIGS["qwen3_moe"]["vocab_size"])
    clen = batch.completion_mask.sum(-1).long()
    with pytest.raises(ValueError, match="do not share one prompt"):
        shared_prompt_logprobs(model, batch.input_ids, batch.prompt_lengths, clen, 3)  # groups of 3 straddle prompts
    with pytest.raises(ValueError, match="not whole groups of 5"):
        shared_prompt_logprobs(model, batch.input_ids, batch.prompt_lengths, clen, 5)


def test_trainer_update_with_and_without_shared_prompts(tmp_path, monkeypatch):
    """One RL update on the same rollout batch: same loss, grad norm and metrics either way
    (several passes and a KL term, so the old and reference passes go through it too)."""
    import trillora.policy.policy

    calls = []
    monkeypatch.setattr(
        trillora.policy.policy,
        "shared_prompt_logprobs",
        lambda *a, **k: calls.append(1) or shared_prompt_logprobs(*a, **k),
    )
    results = []
    for share in (True, False):
        cfg = load_config(
            None,
            [
                f"out_dir={tmp_path}",
                f"parallel.share_prompts={str(share).lower()}",
                "rollout.prompts_per_step=4",
                "rollout.group_size=4",
                "algorithm.minibatches=2",
                "algorithm.kl_coef=0.05",
                'lora.targets=["attention","experts"]',
            ],
        )
        trainer = Trainer(cfg)
        assert trainer.update.share_prompts is share
        batch = trainer.sampler.sample(0)
        advantages = rl.group_advantages(batch.rewards, "grpo", True).reshape(-1)
        results.append(trainer.update(dataclasses.replace(batch.tokens, advantages=advantages)))
        assert len(calls) == 4  # shared: old + reference + 2 minibatches; whole rows add none
    shared, whole = results
    for key in ("loss", "grad_norm", "entropy", "kl_ref", "approx_kl_old", "clip_frac", "is_weight_mean"):
        assert shared[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-7), key
