"""Per-token log-probabilities (and entropies) of chosen tokens from logits.

Shape legend: B rows, T positions, V vocabulary. (A vocabulary split over tensor-parallel ranks
is combined in `trillora.parallel.vocab_parallel`, on logits scaled here.)
"""

from __future__ import annotations

import torch


def scale_by_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T, the distribution the sampler drew from (T = 0, greedy, is reported at T = 1)."""
    if temperature > 0 and temperature != 1.0:  # x / 1 is x: skip a pass over [B, T, V]
        return logits / temperature
    return logits


def log_distribution(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) over the vocabulary, [..., V]: every distribution trillora
    reads logprobs, top-k or draws off (T = 0, greedy, is read at T = 1)."""
    return scale_by_temperature(logits, temperature).log_softmax(-1)


def logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[target] for logits [B, T, V] and targets [B, T] (or [B, T, K]:
    K candidates per position): shaped as targets (and the entropy [B, T])."""
    logp_all = log_distribution(logits, temperature)  # [B, T, V]
    per_position = targets.dim() == logits.dim() - 1
    logp = logp_all.gather(-1, targets[..., None] if per_position else targets)  # [B, T, 1 or K]
    logp = logp[..., 0] if per_position else logp
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, entropy
