"""RL math against numbers computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trillora import rl


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    grpo = rl.group_advantages(r, "grpo")
    assert torch.allclose(grpo[0], torch.tensor([1, -1, 1, -1]) * 0.5 / math.sqrt(1 / 3), atol=1e-5)
    assert torch.equal(grpo[1], torch.zeros(4))  # no signal in an all-equal group
    assert torch.allclose(rl.group_advantages(r, "grpo", normalize_std=False)[0], torch.tensor([0.5, -0.5, 0.5, -0.5]))
    assert torch.allclose(rl.group_advantages(r, "dr_grpo")[0], torch.tensor([0.5, -0.5, 0.5, -0.5]))
    # leave-one-out: 1 - mean(0, 1, 0) = 2/3 ; 0 - mean(1, 1, 0) = -2/3
    assert torch.allclose(rl.group_advantages(r, "loo")[0], torch.tensor([2, -2, 2, -2]) / 3)
    with pytest.raises(ValueError, match="allowed: grpo, dr_grpo, loo"):
        rl.group_advantages(r, "ppo")


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])  # d = 1
    assert rl.kl_estimate(logp, ref, "k1").item() == pytest.approx(1.0)
    assert rl.kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5)
    assert rl.kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-1))
    assert rl.kl_estimate(ref, ref, "k3").item() == 0.0


def test_entropy_by_hand():
    assert rl.entropy_from_logits(torch.zeros(1, 4)).item() == pytest.approx(math.log(4))
    assert rl.entropy_from_logits(torch.tensor([[0.0, -1e9]])).item() == pytest.approx(0.0, abs=1e-6)


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode, expect",
    [("token_mean", 10 / 4), ("seq_mean_token_mean", (2 + 4) / 2), ("seq_mean_token_sum_norm", 10 / (2 * 3))],
)
def test_aggregation_by_hand(mode, expect):
    assert rl.aggregate(LOSS, MASK, mode, global_tokens=4, global_seqs=2, norm_len=3).item() == pytest.approx(expect)


@pytest.mark.parametrize("mode", rl.AGGREGATIONS)
def test_aggregation_gradient_is_split_invariant(mode):
    """Σ over slices of the loss with global counts == the loss of the whole batch (same gradient)."""
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(6, 5, generator=g, requires_grad=True)
    mask = (torch.rand(6, 5, generator=g) > 0.3).long()
    mask[:, 0] = 1
    adv = torch.randn(6, generator=g)
    kw = dict(global_tokens=float(mask.sum()), global_seqs=6.0, aggregation=mode, norm_len=5.0)
    old = logp.detach() + 0.1 * torch.randn(6, 5, generator=g)
    whole, _ = rl.policy_loss(logp, old, adv, mask, **kw)
    (g_whole,) = torch.autograd.grad(whole, logp)
    parts = sum(
        rl.policy_loss(logp[s], old[s], adv[s], mask[s], **kw)[0] for s in (slice(0, 2), slice(2, 3), slice(3, 6))
    )
    (g_parts,) = torch.autograd.grad(parts, logp)
    assert torch.allclose(whole, parts, atol=1e-6) and torch.allclose(g_whole, g_parts, atol=1e-6)


def test_policy_loss_clip_higher_by_hand():
    ratio = torch.tensor([[1.5, 1.1], [0.5, 1.0]])
    old = torch.zeros(2, 2)
    logp = ratio.log().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 2)
    loss, m = rl.policy_loss(logp, old, adv, mask, global_tokens=4, global_seqs=2, clip_low=0.2, clip_high=0.2)
    # tokens: -min(1.5, 1.2) = -1.2 ; -1.1 ; -min(-0.5, -0.8) = 0.8 ; -min(-1, -1) = 1
    assert loss.item() == pytest.approx((-1.2 - 1.1 + 0.8 + 1.0) / 4)
    assert m["clip_frac"] == 0.5 and m["clip_high_frac"] == 0.25 and m["clip_low_frac"] == 0.25
    (grad,) = torch.autograd.grad(loss, logp)
    # d/dlogp of -r·A/4 = -r·A/4 where not clipped; 0 where the clipped branch is taken
    assert torch.allclose(grad, torch.tensor([[0.0, -1.1 / 4], [0.0, 1.0 / 4]]))
    loss_hi, _ = rl.policy_loss(logp, old, adv, mask, global_tokens=4, global_seqs=2, clip_high=0.28)
    assert loss_hi.item() == pytest.approx((-1.28 - 1.1 + 0.8 + 1.0) / 4)  # clip-higher lets token 0 move further


def test_policy_loss_weights_and_kl():
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, m = rl.policy_loss(
        logp,
        torch.zeros(1, 2),
        torch.tensor([1.0]),
        torch.ones(1, 2),
        global_tokens=2,
        global_seqs=1,
        is_weights_BT=torch.tensor([[2.0, 0.5]]),
        ref_logp_BT=torch.tensor([[-1.0, 0.0]]),
        kl_coef=0.1,
        kl_kind="k1",
    )
    # pg: -(2·1 + 0.5·1)/2 = -1.25 ; kl k1: (1 + 0)/2 · 0.1 = 0.05
    assert loss.item() == pytest.approx(-1.25 + 0.05)
    assert m["kl_ref"] == pytest.approx(0.5)


TRAINER = torch.tensor([[math.log(0.5), math.log(0.2)]])
ROLLOUT = torch.tensor([[math.log(0.25), math.log(0.4)]])  # ratios 2 and 0.5
ONES = torch.ones(1, 2)


def test_token_tis_caps_by_hand():
    w, m = rl.mismatch_weights(TRAINER, ROLLOUT, ONES, "token_tis", cap=1.5)
    assert torch.allclose(w, torch.tensor([[1.5, 0.5]]))
    assert (
        m["is_limited_frac"] == 0.5
        and m["is_ratio_max"] == pytest.approx(2.0)
        and m["is_ratio_min"] == pytest.approx(0.5)
    )
    assert m["is_ess"] == pytest.approx(4 / 5)  # (1.5 + 0.5)^2 / (2 (2.25 + 0.25))
    assert m["mismatch_kl_k1"] == pytest.approx(0.0, abs=1e-6)  # -(ln 2 + ln 0.5) / 2
    assert m["mismatch_kl_k3"] == pytest.approx(((1 - math.log(2)) + (-0.5 + math.log(2))) / 2)


def test_sequence_and_masking_modes_by_hand():
    w, _ = rl.mismatch_weights(TRAINER, ROLLOUT, ONES, "seq_tis", cap=1.5)
    assert torch.allclose(w, ONES)  # Π ρ = 1
    w, m = rl.mismatch_weights(TRAINER, ROLLOUT, ONES, "token_mask", band=(0.6, 1.9))
    assert torch.equal(w, torch.zeros(1, 2)) and m["is_limited_frac"] == 1.0
    w, _ = rl.mismatch_weights(TRAINER, ROLLOUT, ONES, "token_mask", band=(0.5, 2.0))
    assert torch.equal(w, ONES)  # the band is inclusive
    skewed = torch.tensor([[math.log(0.5), math.log(0.4)]])  # ratios 2 and 1: Π = 2, geometric mean √2
    w, _ = rl.mismatch_weights(skewed, ROLLOUT, ONES, "seq_mask", band=(0.5, 1.9))
    assert torch.equal(w, torch.zeros(1, 2))
    w, _ = rl.mismatch_weights(skewed, ROLLOUT, ONES, "geo_mask", band=(0.5, 1.9))
    assert torch.equal(w, ONES)


def test_mismatch_ignores_padding_and_none_mode():
    mask = torch.tensor([[1, 0]])
    w, m = rl.mismatch_weights(TRAINER, ROLLOUT, mask, "none")
    assert torch.equal(w, torch.tensor([[1.0, 0.0]]))
    assert m["is_ratio_mean"] == pytest.approx(2.0) and m["is_limited_frac"] == 0.0
    with pytest.raises(ValueError, match="allowed: none, token_tis"):
        rl.mismatch_weights(TRAINER, ROLLOUT, mask, "tis")


def test_ppo_objective_by_hand_with_scalar_and_per_token_bounds():
    from trillora.rl.loss import ppo_objective

    ratio, adv = torch.tensor([0.5, 1.0, 1.5]), torch.tensor([1.0, -1.0, 1.0])
    objective, unclipped, clipped = ppo_objective(ratio, adv, 0.8, 1.2)
    assert objective.tolist() == pytest.approx([0.5, -1.0, 1.2])  # min(r·A, clip(r)·A)
    assert unclipped.tolist() == pytest.approx([0.5, -1.0, 1.5]) and clipped.tolist() == pytest.approx([0.8, -1.0, 1.2])
    per_token, _, _ = ppo_objective(ratio, adv, torch.tensor([0.4, 0.9, 0.9]), torch.tensor([2.0, 1.1, 1.4]))
    assert per_token.tolist() == pytest.approx([0.5, -1.0, 1.4])
