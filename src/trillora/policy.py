"""The trainer's view of sampled sequences: batches of prompt + completion and the
log-probabilities the policy gives to the completion tokens.

Rows are right-padded, so plain causal attention is exact for the real tokens and no
padding mask is needed. Shape legend: B rows, T tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .models.kv_cache import SharedPrefixCache
from .models.transformer import CausalLM


@dataclass(kw_only=True)
class TokenBatch:
    input_ids: torch.Tensor  # [B, T] prompt + completion, right-padded
    completion_mask: torch.Tensor  # [B, T-1]: 1 where target token t+1 is a completion token
    rollout_logprobs: torch.Tensor  # [B, T-1] engine logprobs aligned with the mask (0 elsewhere)
    prompt_lengths: torch.Tensor | None = None  # [B] tokens of each row's prompt
    routes: torch.Tensor | None = None  # [B, T, L, K] experts the engine chose per input token (int16)
    routes_valid: torch.Tensor | None = None  # [B, T] True where the engine fed that token (all but the last)

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())


def build_batch(prompts: list[list[int]], completions: list[list[int]], logprobs: list[list[float]], pad_id: int = 0,
                device: torch.device | str = "cpu", routes: list[torch.Tensor] | None = None) -> TokenBatch:
    """`routes`: each completion's recorded routing [len(prompt) + len(completion) - 1, L, K], or None."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    b = len(prompts)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros(b, width - 1)
    lps = torch.zeros(b, width - 1)
    for i, (p, c, lp) in enumerate(zip(prompts, completions, logprobs)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        # target position j predicts token j+1: completion token k sits at len(p)+k, predicted at len(p)+k-1
        mask[i, len(p) - 1 : len(p) - 1 + len(c)] = 1
        lps[i, len(p) - 1 : len(p) - 1 + len(c)] = torch.tensor(lp, dtype=torch.float32)
    batch = TokenBatch(input_ids=ids.to(device), completion_mask=mask.to(device), rollout_logprobs=lps.to(device),
                       prompt_lengths=torch.tensor([len(p) for p in prompts], device=device))
    if routes is not None:
        layers, k = routes[0].shape[1:]
        table = torch.zeros(b, width, layers, k, dtype=torch.int16)
        valid = torch.zeros(b, width, dtype=torch.bool)
        for i, r in enumerate(routes):
            table[i, : r.shape[0]] = r.to(torch.int16)
            valid[i, : r.shape[0]] = True
        batch.routes, batch.routes_valid = table.to(device), valid.to(device)
    return batch


def token_logprobs(model: CausalLM, input_ids: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature) of each next token: [B, T-1] (and the entropy [B, T-1]).

    Under context parallelism (`model.context_parallel`) the model returns this rank's tokens
    only; their logprobs are gathered into whole rows, the same on every rank of the group."""
    cp = getattr(model, "context_parallel", None)
    logits = model.lm_head(model.hidden_states(input_ids)).float()  # [B, T or t, V]; slice after the head
    if cp is None:
        logits, targets = logits[:, :-1], input_ids[:, 1:]
    else:
        targets = cp.next_tokens(input_ids)
    logp, entropy = logprobs_from_logits(logits, targets, temperature, getattr(model, "vocab_parallel_group", None),
                                         with_entropy)
    if cp is not None:
        n = input_ids.shape[1] - 1
        logp = cp.gather(logp, n)
        entropy = cp.gather(entropy, n) if with_entropy else None
    return logp, entropy


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_group=None,
                         with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of `targets` [B, T] under logits [B, T, V] (a vocabulary slice when `vocab_group`
    is set: trillora.parallel.vocab_parallel) and optionally the entropy."""
    if temperature > 0 and temperature != 1.0:  # x / 1 is x: skip a pass over [B, T, V]
        logits = logits / temperature
    if vocab_group is not None:
        from .parallel.vocab_parallel import vocab_parallel_logprobs

        return vocab_parallel_logprobs(logits, targets, vocab_group, with_entropy)
    logp_all = logits.log_softmax(-1)  # [B, T, V]
    logp = logp_all.gather(-1, targets[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, entropy


def shared_prompt_logprobs(model: CausalLM, input_ids: torch.Tensor, prompt_lengths: torch.Tensor,
                           completion_lengths: torch.Tensor, group_size: int, temperature: float = 1.0,
                           with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        h = torch.cat([h, model.hidden_states(comp[:, :-1], attention_mask=full_mask, cache=cache)], dim=1)  # [B, Tc, C]
    logits = model.lm_head(h).float()
    logp, entropy = logprobs_from_logits(logits, comp, temperature, getattr(model, "vocab_parallel_group", None),
                                         with_entropy)  # [B, Tc]

    # back to whole-row positions: target j predicts token j+1, so completion k sits at plen-1+k
    k = torch.arange(t - 1, device=dev) - (plen[:, None] - 1)  # [B, T-1]
    valid = (k >= 0) & (k < tc)
    kk = k.clamp(0, tc - 1)

    def place(x):
        return torch.where(valid, x.gather(1, kk), 0.0)

    return place(logp), (place(entropy) if with_entropy else None)
