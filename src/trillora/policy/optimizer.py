"""The one optimizer path for adapters, taken by `trillora train` and by the service's `optim_step`.

AdamW per adapter (`adamw`: the one place an adapter's optimizer is built), then one step
(`optimizer_step`): the gradients summed over the ranks that share them, the global norm with every
part counted once, clipping to `max_norm`, and the step itself only when that norm is finite, so a
NaN or an infinity never reaches the adapter. Where the gradients live over the ranks is the
layout's business (`parallel.data_parallel.GradientSync`); one process has none.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ..models.layers import local
from ..parallel.data_parallel import GradientSync


def adamw(
    params: Iterable[nn.Parameter],
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
) -> torch.optim.AdamW:
    """An adapter's AdamW (decoupled weight decay, as torch); defaults are torch's."""
    return torch.optim.AdamW(list(params), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


@dataclass(frozen=True)
class StepOutcome:
    norm: float
    """The gradient's global L2 norm before clipping (NaN or inf when the step was dropped)."""
    stepped: bool
    sent_bytes: int
    """What this rank sent into the gradient sum."""


@torch.no_grad()
def optimizer_step(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter], sync: GradientSync | None, max_norm: float
) -> StepOutcome:
    """Sum, measure, clip (`max_norm` 0: never) and step; the gradients are cleared either way.
    `params`: what `optimizer` steps; `sync`: the ranks they live on (None: one process)."""
    if sync is None:
        sent, norm = 0, torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    else:
        sent = sync()
        norm = sync.norm()  # equal on every rank, so every rank clips and steps alike
        if math.isfinite(float(norm)) and max_norm > 0:
            coef = min(1.0, max_norm / (float(norm) + 1e-6))
            for p in params:
                if p.grad is not None:
                    local(p.grad).mul_(coef)
    stepped = bool(torch.isfinite(norm))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepOutcome(float(norm), stepped, sent)
