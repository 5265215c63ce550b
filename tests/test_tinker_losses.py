"""The Tinker-named losses on one two-token datum, values and gradients computed by hand.

logp = [-1.0, -0.5], sampler's logprobs = [-1.2, -0.5], advantages = [2, -1]:
r = [e^0.2, 1] = [1.2214028, 1].
"""

import math

import pytest
import torch

from trillora.rl.tinker_losses import LossInputError, check_loss, datum_loss

R0 = math.exp(0.2)


def inputs(**extra):
    return {
        "target_tokens": torch.tensor([5, 6]),
        "logprobs": torch.tensor([-1.2, -0.5]),
        "advantages": torch.tensor([2.0, -1.0]),
        **extra,
    }


def run(name, config=None, **extra):
    logp = torch.tensor([-1.0, -0.5], requires_grad=True)
    loss = datum_loss(name, logp, inputs(**extra), config)
    loss.backward()
    return float(loss), logp.grad.tolist()


def test_cross_entropy_sums_weighted_logprobs():
    loss, grad = run("cross_entropy", weights=torch.tensor([0.0, 1.0]))
    assert loss == pytest.approx(0.5) and grad == pytest.approx([0.0, -1.0])
    assert run("cross_entropy")[0] == pytest.approx(1.5)  # no weights: every token


def test_importance_sampling_is_ratio_times_advantage():
    loss, grad = run("importance_sampling")
    assert loss == pytest.approx(-(2 * R0 - 1))
    assert grad == pytest.approx([-2 * R0, 1.0])  # d(-r·A)/dlogp = -r·A
    assert run("importance_sampling", weights=torch.tensor([1.0, 0.0]))[0] == pytest.approx(-2 * R0)


def test_ppo_takes_the_clipped_branch_above_1_2():
    loss, grad = run("ppo")
    assert loss == pytest.approx(-(1.2 * 2 - 1))  # token 0: min(2.4428, 2.4) = 2.4
    assert grad == pytest.approx([0.0, 1.0])  # no gradient through the clipped token
    loss, grad = run("ppo", {"clip_high_threshold": 1.5})
    assert loss == pytest.approx(-(2 * R0 - 1)) and grad == pytest.approx([-2 * R0, 1.0])
    # per-token bounds from loss_fn_inputs win over the config's
    assert run("ppo", {"clip_high_threshold": 1.5}, clip_high_threshold=torch.tensor([1.1, 1.1]))[0] == pytest.approx(
        -(2.2 - 1)
    )


def test_cispo_weights_logp_by_the_stopped_clipped_ratio():
    loss, grad = run("cispo")
    assert loss == pytest.approx(-(1.2 * -1.0 * 2 + 1 * -0.5 * -1))  # 1.9
    assert grad == pytest.approx([-2.4, 1.0])


def test_dro_adds_a_quadratic_penalty():
    loss, grad = run("dro", {"beta": 0.1})
    assert loss == pytest.approx(-((-1.0 * 2 - 0.05 * 0.04) + 0.5))  # 1.502
    assert grad == pytest.approx([-(2 - 0.1 * 0.2), 1.0])


S = math.exp(0.1)  # gspo's sequence ratio: exp(mean(0.2, 0))


def test_gspo_gives_every_token_the_sequence_ratio_and_its_own_gradient():
    mask = torch.tensor([1.0, 1.0])
    loss, grad = run("gspo", sequence_ratio_mask=mask)
    assert loss == pytest.approx(-(2 * S - S)) and grad == pytest.approx([-2 * S, S])
    # clipped above 1.05: token 0 (A > 0) takes the clipped branch (no gradient), token 1 (A < 0) does not
    loss, grad = run("gspo", {"clip_high_threshold": 1.05}, sequence_ratio_mask=mask)
    assert loss == pytest.approx(-(2 * 1.05 - S)) and grad == pytest.approx([0.0, S])
    # the ratio is the mean over the marked tokens only: token 0 alone gives r = e^0.2 on both
    loss, grad = run("gspo", sequence_ratio_mask=torch.tensor([1.0, 0.0]), clip_high_threshold=torch.tensor([2.0, 2.0]))
    assert loss == pytest.approx(-(2 * R0 - R0)) and grad == pytest.approx([-2 * R0, R0])
    with pytest.raises(LossInputError, match="sequence_ratio_mask marks no token"):
        run("gspo", sequence_ratio_mask=torch.tensor([0.0, 0.0]))


@pytest.mark.parametrize(
    "name, keys, config, message",
    [
        ("stable_reinforce", {"target_tokens", "logprobs", "advantages"}, None, "'stable_reinforce' is not served"),
        ("gspo", {"target_tokens", "logprobs", "advantages"}, None, "'gspo' needs loss_fn_inputs sequence_ratio_mask"),
        ("grpo", {"target_tokens"}, None, "unknown loss_fn 'grpo'; choose one of cross_entropy, importance_sampling"),
        ("ppo", {"target_tokens", "logprobs"}, None, "'ppo' needs loss_fn_inputs advantages"),
        ("ppo", {"target_tokens", "logprobs", "advantages"}, {"beta": 1.0}, r"\['beta'\] are not used by 'ppo'"),
        ("dro", {"target_tokens", "logprobs", "advantages"}, None, "'dro' needs loss_fn_config"),
        ("cross_entropy", {"weights"}, None, "needs loss_fn_inputs target_tokens"),
    ],
)
def test_bad_loss_requests_name_the_culprit(name, keys, config, message):
    with pytest.raises(LossInputError, match=message):
        check_loss(name, keys, config)
