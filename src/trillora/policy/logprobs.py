"""The log-probabilities the policy gives to tokens, the one place they are read off the head:
the next tokens of sampled rows (`token_logprobs`; each group's prompt run once:
`shared_prompt_logprobs`), each datum's targets, [N] or [N, K] (`target_logprobs`, what the
Tinker losses read), and what a sample request asks beyond its tokens: prompt logprobs, top-k,
targets and draws at prompt positions (`score_prompt`), the top-k of sampled ones (`topk_sampled`).
Whole logits, a context-parallel rank's positions and a vocabulary-parallel head's slices all go
through `head_logprobs`.

Rows are right-padded, so plain causal attention is exact for the real tokens and no
padding mask is needed. Shape legend: B rows, T tokens, V vocabulary, C hidden channels.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..models.kv_cache import SharedPrefixCache
from ..models.transformer import CausalLM
from ..parallel.vocab_parallel import head_logprobs, next_token_logprobs_at
from ..rl.logprobs import log_distribution


def token_logprobs(
    model: CausalLM, input_ids: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature) of each next token: [B, T-1] (and the entropy [B, T-1]).

    Under context parallelism (`model.context_parallel`) the model returns this rank's tokens
    only; their logprobs are gathered into whole rows, the same on every rank of the group."""
    return next_token_logprobs_of(
        model, model.lm_head(model.hidden_states(input_ids)), input_ids, temperature, with_entropy
    )


def next_token_logprobs_of(
    model, logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` of logits the model already gave for `input_ids` ([B, T or t, V]: a pipeline
    stage's, `parallel.staged`)."""
    cp, group = getattr(model, "context_parallel", None), getattr(model, "vocab_parallel_group", None)
    return next_token_logprobs_at(logits, input_ids, temperature, cp, group, with_entropy)


def next_token_logprobs(model: CausalLM):
    """`token_logprobs` of `model` without a gradient, as a function of the ids alone: what scores a
    context's chunks for Memory Diffusion (`context.diffusion.surprise`, `policy_scores`)."""

    @torch.no_grad()
    def logprobs(input_ids: torch.Tensor) -> torch.Tensor:
        return token_logprobs(model, input_ids)[0]  # [B, T-1]

    return logprobs


def shared_prompt_logprobs(
    model: CausalLM,
    input_ids: torch.Tensor,
    prompt_lengths: torch.Tensor,
    completion_lengths: torch.Tensor,
    group_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` at the completion positions, with each group's prompt run once.

    Rows come in groups of `group_size` consecutive rows sharing one prompt (GRPO's G samples).
    The P prompts run left-padded as [P, Tp]; the completions, all but their last token (which
    predicts nothing), run as [B, Tc-1] attending to their group's prompt keys
    (`SharedPrefixCache`). Same numbers as the whole-row forward up to summation order, for
    P·Tp + B·(Tc-1) tokens instead of B·T. Positions before the completion are 0; like the
    whole-row forward's padding positions, they are zeroed by the completion mask in every loss.
    """
    b, t = input_ids.shape
    g, dev = group_size, input_ids.device
    if b % g:
        raise ValueError(f"{b} rows are not whole groups of {g}")
    plen, clen = prompt_lengths.to(dev), completion_lengths.to(dev)  # [B], [B]
    tp = int(plen.max())
    if int(plen.min()) < 1:
        raise ValueError("every row needs a prompt token")
    cols = torch.arange(tp, device=dev)
    start = tp - plen  # [B] left padding of each prompt
    left = torch.where(cols >= start[:, None], input_ids.gather(1, (cols - start[:, None]).clamp(min=0)), 0)  # [B, Tp]
    pmask = (cols >= start[:, None]).long()
    if not torch.equal(left.view(-1, g, tp), left.view(-1, g, tp)[:, :1].expand(-1, g, tp)):
        raise ValueError(f"rows of a group of {g} do not share one prompt")

    tc = max(int(clen.max()), 1)  # completion tokens, right-padded: row i's from its prompt's end
    src = plen[:, None] + torch.arange(tc, device=dev)  # [B, Tc]
    comp = torch.where(src < t, input_ids.gather(1, src.clamp(max=t - 1)), 0)

    cache = SharedPrefixCache(g)
    h_prompt = model.hidden_states(left[::g], attention_mask=pmask[::g], cache=cache)  # [P, Tp, C]
    h = h_prompt[:, -1:].repeat_interleave(g, 0)  # [B, 1, C] predicts completion token 0
    if tc > 1:  # completion token k > 0 is predicted by completion token k-1
        full_mask = torch.cat([pmask, torch.ones(b, tc - 1, dtype=pmask.dtype, device=dev)], dim=1)
        h = torch.cat(
            [h, model.hidden_states(comp[:, :-1], attention_mask=full_mask, cache=cache)], dim=1
        )  # [B, Tc, C]
    logits = model.lm_head(h).float()
    logp, entropy = head_logprobs(
        logits, comp, temperature, getattr(model, "vocab_parallel_group", None), with_entropy
    )  # [B, Tc]

    # back to whole-row positions: target j predicts token j+1, so completion k sits at plen-1+k
    k = torch.arange(t - 1, device=dev) - (plen[:, None] - 1)  # [B, T-1]
    valid = (k >= 0) & (k < tc)
    kk = k.clamp(0, tc - 1)

    def place(x):
        return torch.where(valid, x.gather(1, kk), 0.0)

    return place(logp), (place(entropy) if with_entropy else None)


def target_logprobs(logits: torch.Tensor, targets: list[torch.Tensor], cp=None, vocab_group=None) -> list[torch.Tensor]:
    """logits [B, T or t, V or V/tp] of right-padded rows of T tokens; `targets`: each datum's ids,
    [N] or [N, K] (N <= T) -> each datum's logprobs, shaped as its targets.

    The gather runs on a [B, T, K] block padded with token 0, each datum keeping its own [:N, :K].
    Under context parallelism (`cp`) the logits are this rank's positions [B, t, V]: their targets
    are taken at the same positions and the [B, t, K] logprobs gathered into whole rows, the same on
    every cp rank (so every rank computes the same loss, and backward keeps this rank's columns)."""
    as_nk = [t.reshape(t.shape[0], -1) for t in targets]  # [N, K] (K = 1 for [N])
    width, k = max(t.shape[0] for t in as_nk), max(t.shape[1] for t in as_nk)
    ids = torch.zeros(len(targets), width, k, dtype=torch.long, device=logits.device)  # [B, T, K]
    for i, t in enumerate(as_nk):
        ids[i, : t.shape[0], : t.shape[1]] = t
    if cp is not None:
        ids = cp.split(ids)  # [B, t, K]: the targets of this rank's positions
    logp = head_logprobs(logits.float(), ids, 1.0, vocab_group)[0]  # [B, T or t, K]
    if cp is not None:
        logp = cp.gather(logp, width)  # [B, T, K] whole rows, on every cp rank
    return [
        logp[i, : nk.shape[0], : nk.shape[1]].reshape(t.shape)
        for i, (t, nk) in enumerate(zip(targets, as_nk, strict=True))
    ]


# --- what a sample request may ask beyond its tokens (the Tinker sampler) ------------------
# Prompt scores come from the untempered distribution (as prompt logprobs always have); draws and
# the top-k of sampled positions from the one the token was drawn from (temperature-scaled, before
# top-k / top-p truncation: the one `rollout.sampling` takes a sampled token's logprob from).
# Position i of a prompt of N tokens is predicted by the logits at i - 1, so position 0 has no score.
# Shape legend here: N prompt tokens, L sampled tokens, V vocabulary, K targets or top-k width.

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
