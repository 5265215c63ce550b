"""Group-relative advantages: each prompt's G samples are scored against each other.

Shape legend: P prompts, G samples per prompt (the group).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

AdvantageMode = Literal["grpo", "dr_grpo", "loo"]
ADVANTAGE_MODES: tuple[str, ...] = get_args(AdvantageMode)


def group_advantages(
    rewards_PG: torch.Tensor, mode: str = "grpo", normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Advantages [P, G].

    - `grpo` (DeepSeekMath, arXiv:2402.03300): r - mean(group), divided by the group's std when `normalize_std`.
    - `dr_grpo` (Dr. GRPO, arXiv:2503.20783): r - mean(group), never divided by the std (removes its difficulty bias).
    - `loo` (leave-one-out / RLOO, arXiv:2402.14740): r minus the mean of the *other* G-1 samples,
      = G/(G-1) · (r - mean).
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"advantage mode {mode!r}; allowed: {', '.join(ADVANTAGE_MODES)}")
    r = rewards_PG.float()
    g = r.shape[-1]
    centred = r - r.mean(dim=-1, keepdim=True)
    if mode == "loo":
        if g < 2:
            raise ValueError("leave-one-out advantages need at least 2 samples per group")
        return centred * g / (g - 1)
    if mode == "grpo" and normalize_std:
        return centred / (r.std(dim=-1, keepdim=True, unbiased=True) + eps) if g > 1 else centred
    return centred
