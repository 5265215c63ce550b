"""What a Tinker sample request may ask beyond the sampled tokens, read off the model's next-token
distributions: prompt logprobs (all, or the last n), the top-k at each prompt position, the
logprobs of given target ids, k independent draws at each prompt position, and the top-k at each
sampled position.

Prompt scores come from the untempered distribution (as prompt logprobs always have); draws and
the top-k of sampled positions from the one the token was drawn from (temperature-scaled, before
top-k / top-p truncation: the same one `rollout.sampling` takes a sampled token's logprob from).
Position i of a prompt of N tokens is predicted by the logits at i - 1, so position 0 has no score.
Shape legend: N prompt tokens, L sampled tokens, V vocabulary, K targets or top-k width.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..rl.logprobs import log_distribution

MASK_LOGPROB = -99999.0
"""The SDK's sentinel for a top-k row that was not computed (with token id 0)."""


def topk_rows(logp: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [R, k], logprobs float32 [R, k]) of the k most likely tokens of each row of `logp` [R, V]."""
    values, ids = logp.topk(k, dim=-1)
    return ids.to(torch.int32).cpu().numpy(), values.cpu().numpy()


def score_prompt(
    logits: torch.Tensor,
    prompt: list[int],
    options: dict,
    want_logprobs: bool,
    temperature: float,
    generator: torch.Generator | None,
) -> dict:
    """`logits` [N, V] of the prompt -> {"prompt_logprobs": [N] (NaN unscored), "topk_prompt": (ids, lps) [N, k],
    "targets": [N-1, K], "alt": (ids [N-1, k], lps [N-1, k])}, each only when asked."""
    n = len(prompt)
    logp = log_distribution(logits.float())  # [N, V]
    first = n - options.get("prompt_logprobs_last_n", n - 1)  # the first prompt position scored
    out: dict = {}
    if want_logprobs:
        ids = torch.tensor(prompt[1:], device=logits.device)
        scored = logp[:-1].gather(-1, ids[:, None])[:, 0].tolist()  # [N-1]: position i+1's logprob
        out["prompt_logprobs"] = [math.nan] * first + scored[first - 1 :]
    if k := options.get("topk_prompt_logprobs"):
        ids, lps = np.zeros((n, k), np.int32), np.full((n, k), MASK_LOGPROB, np.float32)
        ids[first:], lps[first:] = topk_rows(logp[first - 1 : -1], k)
        out["topk_prompt"] = (ids, lps)
    if (targets := options.get("target_prompt_logprobs")) is not None:
        asked = torch.as_tensor(targets, device=logits.device)  # [N-1, K], -1: nothing
        got = logp[:-1].gather(-1, asked.clamp(min=0))
        out["targets"] = torch.where(asked >= 0, got, torch.zeros_like(got)).cpu().numpy().astype(np.float32)
    if k := options.get("prompt_alt_tokens_k"):
        scaled = log_distribution(logits[:-1].float(), temperature)  # [N-1, V]
        if temperature > 0:
            draws = torch.multinomial(scaled.exp(), k, replacement=True, generator=generator)
        else:  # greedy: every draw is the most likely token
            draws = scaled.argmax(-1, keepdim=True).expand(-1, k)
        out["alt"] = (draws.cpu().numpy().astype(np.int64), scaled.gather(-1, draws).cpu().numpy().astype(np.float32))
    return out


def topk_sampled(
    logits: torch.Tensor, n_prompt: int, tokens: list[int], k: int, temperature: float
) -> tuple[np.ndarray, np.ndarray]:
    """`logits` [N + L - 1, V] of the prompt and the sampled tokens but the last -> the top-k of the
    distribution each sampled token was drawn from, [L, k]."""
    rows = logits[n_prompt - 1 : n_prompt - 1 + len(tokens)]  # [L, V]
    return topk_rows(log_distribution(rows.float(), temperature), k)
