"""The clipped policy-gradient objective with mismatch weights, KL to the reference and entropy.

Shape legend: B sequences, T tokens; mask [B, T] is 1 on completion tokens.
"""

from __future__ import annotations

import torch

from .aggregation import aggregate
from .kl import kl_estimate
from .mismatch import masked_mean


def ppo_objective(
    ratio: torch.Tensor, adv: torch.Tensor, low: float | torch.Tensor, high: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's per-token objective min(r·A, clip(r, low, high)·A) (Schulman et al. 2017), and its two
    branches (unclipped r·A, clipped): the trainer's loss and the Tinker `ppo` / `gspo` losses."""
    unclipped = ratio * adv
    clipped = ratio.clamp(low, high) * adv
    return torch.minimum(unclipped, clipped), unclipped, clipped


def policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    global_tokens: float,
    global_seqs: float,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: str = "token_mean",
    norm_len: float = 1.0,
    is_weights_BT: torch.Tensor | None = None,
    ref_logp_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    entropy_BT: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip (Schulman et al. 2017) with separate low/high clip ranges ("clip-higher", DAPO
    arXiv:2503.14476): per token  -min(r·A, clip(r, 1-clip_low, 1+clip_high)·A),  r = π/π_old,
    times the mismatch weight, plus kl_coef·KL(π || π_ref) minus entropy_coef·H."""
    mask = mask_BT.bool()
    log_ratio = (logp_BT - old_logp_BT).masked_fill(~mask, 0.0)
    ratio = log_ratio.exp()
    adv = advantages_B.to(logp_BT.dtype)[:, None]  # [B, 1]
    objective, unclipped, clipped = ppo_objective(ratio, adv, 1.0 - clip_low, 1.0 + clip_high)
    loss_BT = -objective
    if is_weights_BT is not None:
        loss_BT = loss_BT * is_weights_BT.detach()
    metrics: dict[str, float] = {}
    if kl_coef and ref_logp_BT is not None:
        kl = kl_estimate(logp_BT, ref_logp_BT.detach(), kl_kind)
        loss_BT = loss_BT + kl_coef * kl
        metrics["kl_ref"] = float(masked_mean(kl.detach(), mask))
    if entropy_coef and entropy_BT is not None:
        loss_BT = loss_BT - entropy_coef * entropy_BT
    if entropy_BT is not None:
        metrics["entropy"] = float(masked_mean(entropy_BT.detach(), mask))
    loss = aggregate(loss_BT, mask, aggregation, global_tokens, global_seqs, norm_len)
    with torch.no_grad():
        active = clipped < unclipped  # the clipped branch is the minimum: no gradient through r
        metrics.update(
            clip_frac=float(masked_mean(active.float(), mask)),
            clip_low_frac=float(masked_mean((active & (ratio < 1.0)).float(), mask)),
            clip_high_frac=float(masked_mean((active & (ratio > 1.0)).float(), mask)),
            approx_kl_old=float(masked_mean(torch.expm1(-log_ratio) + log_ratio, mask)),
        )
    return loss, metrics
