"""Correcting for the rollout engine not being the trainer.

Rollouts are sampled by an inference engine (ours with bf16-rounded merged weights, or
vLLM) whose probabilities differ slightly from the trainer's. With ρ_t = π_train(y_t) /
π_rollout(y_t) per token, the policy gradient is reweighted by a truncated or masked ρ
(truncated importance sampling: Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"; IcePop / verl rollout correction for the masking modes).

Shape legend: B sequences, T tokens; mask [B, T] is 1 on completion tokens.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

MismatchMode = Literal["none", "token_tis", "seq_tis", "token_mask", "seq_mask", "geo_mask"]
MISMATCH_MODES: tuple[str, ...] = get_args(MismatchMode)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def mismatch_weights(
    trainer_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str = "token_tis",
    cap: float = 2.0,
    band: tuple[float, float] = (0.5, 2.0),
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights [B, T] (no gradient) and metrics of the mismatch.

    - `token_tis`: w_t = min(ρ_t, cap)
    - `seq_tis`: w = min(Π_t ρ_t, cap) for every token of the sequence
    - `token_mask`: w_t = 1 if band[0] <= ρ_t <= band[1] else 0
    - `seq_mask`: the whole sequence kept iff Π_t ρ_t is inside the band
    - `geo_mask`: kept iff the geometric mean (Π_t ρ_t)^(1/T) is inside the band
    - `none`: w = 1; metrics are still reported.
    """
    if mode not in MISMATCH_MODES:
        raise ValueError(f"mismatch correction {mode!r}; allowed: {', '.join(MISMATCH_MODES)}")
    mask = mask_BT.bool()
    log_ratio = (trainer_logp_BT - rollout_logp_BT).detach().float().masked_fill(~mask, 0.0)
    ratio = log_ratio.exp()  # [B, T], 1 on padding
    seq_log_ratio = log_ratio.sum(-1, keepdim=True)  # [B, 1]
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    low, high = band
    ones = torch.ones_like(ratio)
    if mode == "none":
        weights, limited = ones, torch.zeros_like(mask)
    elif mode == "token_tis":
        weights, limited = ratio.clamp(max=cap), ratio > cap
    elif mode == "seq_tis":
        seq = seq_log_ratio.exp()
        weights, limited = seq.clamp(max=cap).expand_as(ratio), (seq > cap).expand_as(mask)
    elif mode == "token_mask":
        keep = (ratio >= low) & (ratio <= high)
        weights, limited = keep.float(), ~keep
    else:
        stat = seq_log_ratio if mode == "seq_mask" else seq_log_ratio / lengths
        keep = (stat >= torch.log(torch.tensor(low))) & (stat <= torch.log(torch.tensor(high)))
        weights, limited = keep.float().expand_as(ratio), (~keep).expand_as(mask)
    weights = weights * mask
    m = mask.float()
    n = m.sum().clamp(min=1.0)
    w_valid = weights[mask]
    metrics = {
        "is_ratio_mean": float(masked_mean(ratio, mask)),
        "is_ratio_min": float(ratio[mask].min()) if mask.any() else 1.0,
        "is_ratio_max": float(ratio[mask].max()) if mask.any() else 1.0,
        "is_weight_mean": float(w_valid.mean()) if mask.any() else 1.0,
        "is_weight_max": float(w_valid.max()) if mask.any() else 1.0,
        "is_limited_frac": float((limited & mask).float().sum() / n),  # capped (TIS) or masked (mask modes)
        # effective sample size of the weights, as a fraction of the tokens: (Σw)² / (N Σw²)
        "is_ess": float(w_valid.sum() ** 2 / (n * w_valid.square().sum()).clamp(min=1e-12)) if mask.any() else 1.0,
        # KL(rollout || trainer) from samples of the rollout policy: k1 = -log ρ, k3 = ρ - 1 - log ρ
        "mismatch_kl_k1": float(masked_mean(-log_ratio, mask)),
        "mismatch_kl_k3": float(masked_mean(ratio - 1 - log_ratio, mask)),
    }
    return weights.detach(), metrics
