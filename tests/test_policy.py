"""`policy.Policy`'s verbs in one process: forward and forward_backward against autograd on the
model's own logprobs, optim_step against torch's AdamW (a NaN dropped), state() / load() as a
resume that takes the same next step."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import CONFIGS

from trillora import lora
from trillora.models import build_model, from_hf_config
from trillora.parallel import ParallelDims
from trillora.policy import adamw
from trillora.policy.logprobs import token_logprobs
from trillora.policy.policy import Policy, Rows
from trillora.policy.world import World


def _policy() -> Policy:
    model = build_model(from_hf_config(CONFIGS["qwen3_moe"]), device="cpu")
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    lora.apply_lora(model, lora.LoraConfig(rank=4, targets=("attention", "experts")))
    with torch.no_grad():
        for _, p in lora.lora_parameters(model):
            p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    named = dict(lora.trained_parameters(model))
    world = World.start(model, ParallelDims(), torch.device("cpu"))
    return Policy(model, world, named, adamw(named.values(), lr=0.05), model)


def _rows() -> Rows:
    ids = torch.tensor([[1, 5, 6, 7, 9], [1, 5, 6, 3, 0], [1, 9, 10, 11, 12], [1, 9, 10, 4, 2]])
    return Rows(ids, 2, torch.tensor([3, 3, 3, 3]), torch.tensor([2, 1, 2, 2]))


def _loss(weights: torch.Tensor):
    """A weighted sum of the logprobs: each row's share is its rows of `weights` [b, T-1]."""
    return lambda logp, entropy, idx: -(logp * weights[idx]).sum()


def test_forward_backward_gives_the_gradient_of_the_loss_on_the_models_logprobs():
    policy, rows = _policy(), _rows()
    weights = torch.rand(4, 4, generator=torch.Generator().manual_seed(3))
    by_hand = copy.deepcopy(policy.model)
    total = policy.forward_backward(rows, _loss(weights), temperature=0.8, micro_rows=1)
    oracle = -(token_logprobs(by_hand, rows.ids, 0.8)[0] * weights).sum()
    oracle.backward()
    assert total == pytest.approx(float(oracle.detach()), rel=1e-5)
    mine, theirs = dict(lora.trained_parameters(policy.model)), dict(lora.trained_parameters(by_hand))
    for name, p in mine.items():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # the forward verb: the same logprobs, none of autograd's state kept
        logp = policy.forward(rows, 0.8, whole_rows=True)
    assert not logp.requires_grad
    torch.testing.assert_close(logp, token_logprobs(by_hand, rows.ids, 0.8)[0], rtol=0, atol=1e-6)


def test_forward_without_the_adapter_is_the_base():
    policy, rows = _policy(), _rows()
    base = copy.deepcopy(policy.model)
    with torch.no_grad():
        for name, p in lora.lora_parameters(base):
            if name.endswith("_B"):
                p.zero_()  # B = 0: the adapter adds nothing
    torch.testing.assert_close(
        policy.forward(rows, adapter=False, whole_rows=True), token_logprobs(base, rows.ids)[0], rtol=0, atol=1e-6
    )
    assert not torch.equal(policy.forward(rows, whole_rows=True), token_logprobs(base, rows.ids)[0])


def test_optim_step_is_adamw_and_drops_a_non_finite_gradient():
    policy, rows = _policy(), _rows()
    oracle = copy.deepcopy(policy)
    weights = torch.ones(4, 4)
    policy.forward_backward(rows, _loss(weights))
    oracle.forward_backward(rows, _loss(weights))
    out, traffic = policy.optim_step(max_norm=0.0)
    torch.optim.AdamW(oracle.params, lr=0.05).step()
    assert out.stepped and traffic == {}
    for p, q in zip(policy.params, oracle.params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    before = [p.detach().clone() for p in policy.params]
    policy.forward_backward(rows, lambda logp, entropy, idx: logp.sum() * float("nan"))
    out, _ = policy.optim_step()
    assert not out.stepped and all(torch.equal(p, b) for p, b in zip(policy.params, before, strict=True))
    assert all(p.grad is None for p in policy.params)


def test_state_then_load_resumes_to_the_same_next_step():
    policy, rows = _policy(), _rows()
    weights = torch.rand(4, 4, generator=torch.Generator().manual_seed(4))
    policy.forward_backward(rows, _loss(weights))
    policy.optim_step()
    saved = {k: v.clone() for k, v in policy.state().items()}
    assert any(k.startswith("optim.") for k in saved)
    policy.forward_backward(rows, _loss(weights))
    policy.optim_step()
    went_on = [p.detach().clone() for p in policy.params]

    other = _policy()  # another process: other weights and a fresh AdamW, then the saved state
    with torch.no_grad():
        for p in other.params:
            p.add_(1.0)
    other.load(saved, "step-1")
    other.forward_backward(rows, _loss(weights))
    other.optim_step()
    for p, q in zip(other.params, went_on, strict=True):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)


def test_save_writes_one_saved_state_that_reads_back_and_resumes(tmp_path):
    """`Policy.save`: the state any face reads (`read_adapter_state`), with the AdamW steps taken; its
    tensors loaded into another policy take the same next step."""
    from trillora.checkpoint.train_state import read_adapter_state, state_meta

    policy, rows = _policy(), _rows()
    weights = torch.rand(4, 4, generator=torch.Generator().manual_seed(5))
    for _ in range(2):
        policy.forward_backward(rows, _loss(weights))
        policy.optim_step()
    config = lora.LoraConfig(rank=4, targets=("attention", "experts"))
    policy.save(tmp_path / "state", state_meta(config, policy.steps, policy.opt))
    saved = read_adapter_state(tmp_path / "state")
    assert saved.optimizer_steps == policy.steps == 2 and saved.lora["targets"] == ("attention", "experts")
    assert saved.lora["rank"] == 4 and saved.lora["alpha"] == config.alpha
    here = policy.state()
    for k, t in here.items():
        if k != "rng.torch":
            assert torch.equal(saved.tensors[k], t), k
    policy.forward_backward(rows, _loss(weights))
    policy.optim_step()
    other = _policy()
    other.load(saved.tensors, tmp_path / "state", rng=False)
    other.forward_backward(rows, _loss(weights))
    other.optim_step()
    for p, q in zip(other.params, policy.params, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
