"""Choosing the next token from logits: temperature, top-k, top-p (nucleus)."""

from __future__ import annotations

import torch


def filter_logits(scaled_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """-inf outside the top-k tokens and outside the smallest set whose probability reaches top_p."""
    out = scaled_BV
    if top_k and top_k < out.shape[-1]:
        kth = out.topk(top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = out.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_next(
    logits_BV: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], logprob [B]) with logprob from the untruncated temperature-scaled softmax."""
    logits_BV = logits_BV.float()
    if temperature == 0:
        tok = logits_BV.argmax(-1)
        return tok, logits_BV.log_softmax(-1).gather(-1, tok[:, None])[:, 0]
    scaled = logits_BV / temperature
    probs = filter_logits(scaled, top_k, top_p).softmax(-1)
    # inverse-CDF sampling: one uniform per row (torch.multinomial draws one exponential per vocabulary entry)
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device) * cdf[:, -1:]
    tok = torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)
    return tok, scaled.log_softmax(-1).gather(-1, tok[:, None])[:, 0]
