"""Minibatches that step: `algorithm.minibatches=M` takes one AdamW step per minibatch (PPO / GRPO),
checked against the same updates written out by hand, and counted in the logs and checkpoints."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from engine_helpers import build_batch
from hf_models import CONFIGS
from safetensors.torch import load_file

from trillora import lora, rl
from trillora.models import build_model, from_hf_config
from trillora.policy.logprobs import token_logprobs
from trillora.policy.policy import Policy
from trillora.policy.world import World
from trillora.trainer import Trainer
from trillora.trainer.update import PolicyUpdate

SETTINGS = (
    "algorithm.minibatches=2",
    'algorithm.mismatch="none"',
    "parallel.share_prompts=false",
    "optim.lr=0.05",
    "optim.grad_clip=0.5",
    "rollout.temperature=0.8",
)


def _policy():
    model = build_model(from_hf_config(CONFIGS["qwen3_moe"]), device="cpu")
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    lora.apply_lora(model, lora.LoraConfig(rank=4, targets=("attention", "experts")))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in lora.lora_parameters(model):
            p.normal_(0.0, 0.05, generator=g)
    return model


def _batch():
    """Two groups of 2 rows (one per minibatch) with rewards that give non-zero advantages."""
    g = torch.Generator().manual_seed(2)
    prompts = [[1, 5, 6], [1, 5, 6], [1, 9, 10, 11], [1, 9, 10, 11]]
    completions = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 2, 4, 1)]
    batch = build_batch(prompts, completions, [[-1.0] * len(c) for c in completions])
    advantages = rl.group_advantages(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), "grpo", True).reshape(-1)
    return dataclasses.replace(batch, advantages=advantages)


def _adam(model, o):
    return torch.optim.AdamW(
        [p for _, p in lora.lora_parameters(model)], lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
    )


def _update(model, cfg) -> PolicyUpdate:
    """The trainer's update over a one-process `Policy` of `model`'s adapter."""
    named, adam = dict(lora.lora_parameters(model)), _adam(model, cfg.optim)
    return PolicyUpdate(Policy(model, World.start(model, cfg.parallel, torch.device("cpu")), named, adam), cfg)


def test_two_minibatches_are_two_sequential_updates(small_config):
    cfg = small_config(*SETTINGS, "rollout.group_size=2")
    a, o = cfg.algorithm, cfg.optim
    model, batch = _policy(), _batch()
    by_hand = copy.deepcopy(model)

    update = _update(model, cfg)
    metrics = update(batch)

    # the same two steps, written out: old logprobs once, then per half a loss normalised by that half
    opt = _adam(by_hand, o)
    params = [p for _, p in lora.lora_parameters(by_hand)]
    with torch.no_grad():
        old = token_logprobs(by_hand, batch.input_ids, 0.8)[0]
    losses = []
    for rows in (torch.tensor([0, 1]), torch.tensor([2, 3])):
        logp, entropy = token_logprobs(by_hand, batch.input_ids[rows], 0.8, with_entropy=True)
        mask = batch.completion_mask[rows]
        loss, _ = rl.policy_loss(
            logp,
            old[rows],
            batch.advantages[rows],
            mask,
            global_tokens=float(mask.sum()),
            global_seqs=2.0,
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            aggregation=a.aggregation,
            norm_len=float(cfg.rollout.max_new_tokens),
            entropy_BT=entropy,
            entropy_coef=a.entropy_coef,
        )
        loss.backward()
        losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for (name, p), (_, q) in zip(lora.lora_parameters(model), lora.lora_parameters(by_hand), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    assert metrics["optimizer_steps"] == 2.0
    assert metrics["loss"] == pytest.approx(sum(losses) / 2, rel=1e-6)
    assert all(int(update.policy.opt.state[p]["step"]) == 2 for _, p in lora.lora_parameters(model))
    # the policy moved between the minibatches: the second one's ratio to the old policy is not 1
    assert metrics["approx_kl_old"] > 0


def test_one_minibatch_is_one_step_on_fresh_samples(small_config):
    """With epochs = minibatches = 1 no old-logprob pass runs (the sampling policy is the current one)."""
    cfg = small_config("rollout.group_size=2")
    model, batch = _policy(), _batch()
    update = _update(model, cfg)
    calls = []
    model.lm_head.register_forward_hook(lambda *args: calls.append(torch.is_grad_enabled()))
    metrics = update(batch)
    assert calls == [True] and metrics["optimizer_steps"] == 1.0 and metrics["approx_kl_old"] == 0.0


def test_a_checkpoint_after_one_step_of_two_minibatches_holds_two_adam_steps(small_config, tmp_path):
    cfg = small_config("steps=1", "eval_every=1", "algorithm.minibatches=2", "checkpoint.every=1", name="mb")
    Trainer(cfg).run()
    rows = [json.loads(x) for x in (tmp_path / "mb" / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["optimizer_steps"] == 2.0
    state = load_file(str(tmp_path / "mb" / "checkpoints" / "step-000001" / "rank-0.safetensors"))
    steps = {k: float(v) for k, v in state.items() if k.startswith("optim.") and k.endswith(".step")}
    assert steps and set(steps.values()) == {2.0}
