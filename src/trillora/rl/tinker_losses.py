"""The Tinker API's built-in losses, per datum, as the Tinker documentation defines them.

Each datum's loss is a sum over its tokens (no normalisation: the client chooses the scale
through its advantages or weights), and a batch's loss is the sum over its datums. `target_logp`
is the trainer's logprob of each target token (position i predicts token i + 1 of the
sequence); `sampling` are the sampler's logprobs of the same tokens (`loss_fn_inputs["logprobs"]`).

    cross_entropy        -Σ w · logp
    importance_sampling  -Σ w · r · A                      r = exp(logp - sampling)
    ppo                  -Σ w · min(r · A, clip(r, lo, hi) · A)
    cispo                -Σ w · sg(clip(r, lo, hi)) · logp · A
    dro                  -Σ w · (logp · A - β/2 · (logp - sampling)²)
    gspo                 -Σ w · min(s_t · A, clip(s_t, lo, hi) · A)
                         s_t = exp(mean_M(sg(logp) - sampling) + logp - sg(logp))

`w` is `loss_fn_inputs["weights"]` where given (1 otherwise); `lo` / `hi` are the absolute
ratio bounds `clip_low_threshold` / `clip_high_threshold` (0.8 / 1.2 by default), from
`loss_fn_config` or per token from `loss_fn_inputs`; dro's `beta` comes from `loss_fn_config`.
gspo is the token-level form of GSPO the Tinker documentation gives: every token carries the
value of the sequence ratio (the geometric mean of the token ratios over the tokens M that
`sequence_ratio_mask` marks) and the gradient of its own logprob; its bounds are ppo's keys and
defaults (the documentation names no others). `stable_reinforce` is refused: its objective uses
"stability information" recorded at sampling whose definition is not published.
Shapes: every tensor is [N], one datum.
"""

from __future__ import annotations

import torch

from ..errors import TrilloraError
from .loss import ppo_objective

TINKER_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
REQUIRED_INPUTS = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"),
}
CONFIG_KEYS = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"),
    "dro": ("beta",),
    "gspo": ("clip_low_threshold", "clip_high_threshold"),
}
DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}  # dro's beta has none: it must be given


class LossInputError(TrilloraError, ValueError):
    """A loss name, input or config value the loss cannot use; the message names it."""


def check_loss(name: str, input_keys: set[str], config: dict | None) -> None:
    """Refuse an unknown loss, a missing input or an unknown config key before any compute."""
    if name == "stable_reinforce":
        raise LossInputError(
            "loss_fn 'stable_reinforce' is not served: its objective is not published; "
            f"choose one of {', '.join(TINKER_LOSSES)} (the cookbook's rl_loop takes loss_fn=gspo, rl/train.py's "
            "async mode async_config.loss_fn=ppo)"
        )
    if name not in TINKER_LOSSES:
        raise LossInputError(f"unknown loss_fn {name!r}; choose one of {', '.join(TINKER_LOSSES)}")
    missing = [k for k in REQUIRED_INPUTS[name] if k not in input_keys]
    if missing:
        raise LossInputError(f"loss_fn {name!r} needs loss_fn_inputs {', '.join(missing)}")
    if name == "dro" and "beta" not in (config or {}):
        raise LossInputError("loss_fn 'dro' needs loss_fn_config {'beta': ...} (the weight of its quadratic penalty)")
    unknown = sorted(set(config or {}) - set(CONFIG_KEYS[name]))
    if unknown:
        allowed = ", ".join(CONFIG_KEYS[name]) or "none"
        raise LossInputError(f"loss_fn_config keys {unknown} are not used by {name!r} (allowed: {allowed})")


def datum_loss(
    name: str, target_logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict | None = None
) -> torch.Tensor:
    """One datum's summed loss (a scalar with the graph of `target_logp` [N])."""
    config = {**DEFAULTS, **(config or {})}
    logp = target_logp
    weights = inputs.get("weights")
    w = weights.to(logp.dtype) if weights is not None else torch.ones_like(logp)
    if name == "cross_entropy":
        return -(w * logp).sum()
    sampling = inputs["logprobs"].to(logp.dtype)
    adv = inputs["advantages"].to(logp.dtype)
    ratio = torch.exp(logp - sampling)
    if name == "importance_sampling":
        objective = ratio * adv
    elif name in ("ppo", "cispo", "gspo"):
        if name == "gspo":  # the sequence ratio's value, each token's own gradient
            in_ratio = inputs["sequence_ratio_mask"] != 0  # [N]
            if not bool(in_ratio.any()):
                raise LossInputError("loss_fn 'gspo': sequence_ratio_mask marks no token")
            log_s = (logp.detach() - sampling)[in_ratio].mean()
            ratio = torch.exp(log_s + logp - logp.detach())
        lo = _bound(inputs, config, "clip_low_threshold", logp)
        hi = _bound(inputs, config, "clip_high_threshold", logp)
        if name in ("ppo", "gspo"):
            objective = ppo_objective(ratio, adv, lo, hi)[0]
        else:  # CISPO: the clipped ratio weighs the logprob's gradient
            objective = ratio.clamp(lo, hi).detach() * logp * adv
    elif name == "dro":
        objective = logp * adv - 0.5 * float(config["beta"]) * (logp - sampling) ** 2
    else:
        raise LossInputError(f"unknown loss_fn {name!r}; choose one of {', '.join(TINKER_LOSSES)}")
    return -(w * objective).sum()


def _bound(inputs: dict[str, torch.Tensor], config: dict, key: str, like: torch.Tensor) -> torch.Tensor:
    """A per-token bound from loss_fn_inputs, else the config's scalar, as a tensor like `like`."""
    if key in inputs:
        return inputs[key].to(like.dtype)
    return torch.full_like(like, float(config[key]))
