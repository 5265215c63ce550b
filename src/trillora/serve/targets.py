"""The logprobs a Tinker loss reads: each datum's log p at its `target_tokens`, from the head's
logits whole, split over the sequence (context parallelism) or over the vocabulary (tp's head).

A datum's targets are [N] (the next token) or [N, K] (K candidates per position: a distillation
or top-k loss), so the gather runs on a [B, T, K] block padded with token 0 and each datum keeps
its own [:N, :K]. Under context parallelism the model returned this rank's positions [B, t, V]:
their targets are taken at the same positions and the [B, t, K] logprobs are gathered into whole
rows, the same on every cp rank (so every rank computes the same loss, and backward keeps this
rank's columns). With a vocabulary-parallel head each tp rank holds V/tp logits and the log-sum-exp
and the target's logit are combined over tp (`parallel.vocab_parallel`): the full [B, T, V] never
exists on one rank. Shape legend: B datums, T tokens (padded), t a cp rank's tokens, V vocabulary.
"""

from __future__ import annotations

import torch

from ..parallel.vocab_parallel import vocab_parallel_logprobs


def target_logprobs(logits: torch.Tensor, targets: list[torch.Tensor], cp=None, vocab_group=None) -> list[torch.Tensor]:
    """logits [B, T or t, V or V/tp] of right-padded rows of T tokens; `targets`: each datum's ids,
    [N] or [N, K] (N <= T) -> each datum's logprobs, shaped as its targets."""
    as_nk = [t.reshape(t.shape[0], -1) for t in targets]  # [N, K] (K = 1 for [N])
    width, k = max(t.shape[0] for t in as_nk), max(t.shape[1] for t in as_nk)
    ids = torch.zeros(len(targets), width, k, dtype=torch.long, device=logits.device)  # [B, T, K]
    for i, t in enumerate(as_nk):
        ids[i, :t.shape[0], :t.shape[1]] = t
    if cp is not None:
        ids = cp.split(ids)  # [B, t, K]: the targets of this rank's positions
    z = logits.float()
    if vocab_group is not None:
        logp = vocab_parallel_logprobs(z, ids, vocab_group)[0]
    else:
        logp = torch.log_softmax(z, dim=-1).gather(-1, ids)  # [B, T or t, K]
    if cp is not None:
        logp = cp.gather(logp, width)  # [B, T, K] whole rows, on every cp rank
    return [logp[i, :nk.shape[0], :nk.shape[1]].reshape(t.shape) for i, (t, nk) in enumerate(zip(targets, as_nk))]
