"""Choosing the next token from logits: temperature, top-k, top-p (nucleus), for every row alike
(`sample_next`) or with each row's own settings and seed (`sample_rows`: requests that share a decode)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def filter_logits(scaled_BV: torch.Tensor, top_k: int | torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """-inf outside the top-k tokens and outside the smallest set whose probability reaches top_p.
    `top_k` [B] and `top_p` [B]: each row's own (0 and 1: no filter)."""
    out, vocab = scaled_BV, scaled_BV.shape[-1]
    if isinstance(top_k, torch.Tensor):
        on = (top_k > 0) & (top_k < vocab)  # [B]
        if bool(on.any()):
            kth = out.sort(dim=-1, descending=True).values.gather(-1, (top_k.clamp(1, vocab) - 1)[:, None])
            out = out.masked_fill(on[:, None] & (out < kth), float("-inf"))
    elif top_k and top_k < vocab:
        kth = out.topk(top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    rows = top_p < 1.0 if isinstance(top_p, torch.Tensor) else None  # [B]
    if (rows is not None and bool(rows.any())) or (rows is None and top_p < 1.0):
        sorted_logits, order = out.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        bound = top_p[:, None] if rows is not None else top_p
        drop_sorted = cum - sorted_logits.softmax(-1) >= bound  # keep the token that crosses top_p
        if rows is not None:
            drop_sorted &= rows[:, None]
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
    tok = _inverse_cdf(probs, torch.rand(probs.shape[0], 1, generator=generator, device=probs.device))
    return tok, scaled.log_softmax(-1).gather(-1, tok[:, None])[:, 0]


def _inverse_cdf(probs_BV: torch.Tensor, u_B1: torch.Tensor) -> torch.Tensor:
    cdf = probs_BV.cumsum(-1)
    return torch.searchsorted(cdf, u_B1 * cdf[:, -1:], right=True)[:, 0].clamp(max=probs_BV.shape[-1] - 1)


@dataclass
class RowSettings:
    """Each row's sampling settings in one decode (the rows of several requests)."""

    temperature: torch.Tensor  # [B], 0 = greedy
    top_k: torch.Tensor  # [B] long, 0 = no filter
    top_p: torch.Tensor  # [B]
    max_new_tokens: torch.Tensor  # [B] long
    stop: torch.Tensor  # [B, S] long, -1 pads
    generators: list[torch.Generator | None]
    """A seeded row's own stream (the same tokens alone or beside any other rows); None: the shared one."""

    @classmethod
    def of(cls, params: list, n: int, device: torch.device) -> RowSettings:
        """Rows of `params[j]` (one `SamplingParams` per prompt, n rows each): a seeded prompt's row i
        draws from seed + i, as an external server's seeded requests do (`SamplingParams.requests`)."""
        rows = [p for p in params for _ in range(n)]
        width = max(1, *(len(p.stop_token_ids) for p in params))
        stop = [list(p.stop_token_ids) + [-1] * (width - len(p.stop_token_ids)) for p in rows]
        generators = []
        for p in params:
            for i in range(n):
                generators.append(None if p.seed is None else torch.Generator(device=device).manual_seed(p.seed + i))
        return cls(
            torch.tensor([p.temperature for p in rows], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in rows], dtype=torch.long, device=device),
            torch.tensor([p.top_p for p in rows], dtype=torch.float32, device=device),
            torch.tensor([p.max_new_tokens for p in rows], dtype=torch.long, device=device),
            torch.tensor(stop, dtype=torch.long, device=device),
            generators,
        )


def sample_rows(
    logits_BV: torch.Tensor, rows: RowSettings, shared: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_next` with each row's own temperature, top-k, top-p and stream: (token [B], logprob [B])."""
    logits_BV = logits_BV.float()
    greedy = rows.temperature == 0  # [B]
    scaled = logits_BV / torch.where(greedy, 1.0, rows.temperature)[:, None]  # greedy rows: temperature 1
    probs = filter_logits(scaled, rows.top_k, rows.top_p).softmax(-1)
    u = torch.empty(len(rows.generators), 1, device=logits_BV.device)  # [B, 1]
    unseeded = [i for i, g in enumerate(rows.generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), 1, generator=shared, device=u.device)
    for i, g in enumerate(rows.generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g, device=u.device)
    tok = torch.where(greedy, logits_BV.argmax(-1), _inverse_cdf(probs, u))
    return tok, scaled.log_softmax(-1).gather(-1, tok[:, None])[:, 0]
