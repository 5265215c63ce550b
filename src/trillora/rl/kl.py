"""Per-token KL estimators between the policy and a reference, from log-probabilities of
the sampled tokens (Schulman, "Approximating KL divergence", 2020).

With log ratio d = logp - ref_logp of tokens sampled from the policy:
  k1 = d                       (unbiased, high variance, can be negative)
  k2 = d² / 2                  (biased, low variance)
  k3 = exp(-d) - 1 + d         (unbiased, always >= 0)
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator {kind!r}; allowed: {', '.join(KL_ESTIMATORS)}")
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    return torch.expm1(-d) + d


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dim: [..., V] -> [...]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
