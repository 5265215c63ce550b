"""The log-probabilities the policy gives to tokens, the one place they are read off the head:
the next tokens of sampled rows (`token_logprobs`; each group's prompt run once:
`shared_prompt_logprobs`), and each datum's targets, [N] or [N, K] (`target_logprobs`, what the
Tinker losses read). Whole logits, a context-parallel rank's positions and a vocabulary-parallel
head's slices all go through `head_logprobs`.

Rows are right-padded, so plain causal attention is exact for the real tokens and no
padding mask is needed. Shape legend: B rows, T tokens, V vocabulary, C hidden channels.
"""

from __future__ import annotations

import torch

from ..models.kv_cache import SharedPrefixCache
from ..models.transformer import CausalLM
from ..parallel.vocab_parallel import head_logprobs


def token_logprobs(
    model: CausalLM, input_ids: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature) of each next token: [B, T-1] (and the entropy [B, T-1]).

    Under context parallelism (`model.context_parallel`) the model returns this rank's tokens
    only; their logprobs are gathered into whole rows, the same on every rank of the group."""
    cp = getattr(model, "context_parallel", None)
    logits = model.lm_head(model.hidden_states(input_ids)).float()  # [B, T or t, V]; slice after the head
    if cp is None:
        logits, targets = logits[:, :-1], input_ids[:, 1:]
    else:
        targets = cp.next_tokens(input_ids)
    logp, entropy = head_logprobs(
        logits, targets, temperature, getattr(model, "vocab_parallel_group", None), with_entropy
    )
    if cp is not None:
        n = input_ids.shape[1] - 1
        logp = cp.gather(logp, n)
        entropy = cp.gather(entropy, n) if with_entropy else None
    return logp, entropy


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
