"""Log-probabilities from a vocabulary-parallel head: each tp rank holds logits for V/tp tokens.

The full [B, T, V] logits never exist on one rank. log p(y) = z_y − logsumexp(z), with the
max, the sum of exponentials and the target's logit each combined over tp by all-reduce
(the max is a constant shift). The entropy needs one more sum, Σ p·z. Everything after
these sums is computed identically on every tp rank, so the backward of each sum is the
identity on the rank's own slice (not another all-reduce, which would count the
replicated loss tp times). Vocabulary shards are contiguous: rank r holds
[r·V/tp, (r+1)·V/tp), DTensor's Shard(0) of lm_head.weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..rl.logprobs import logprobs_from_logits, scale_by_temperature


class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _sum(x: torch.Tensor, group) -> torch.Tensor:
    return _SumOverRanks.apply(x, group)


def vocab_parallel_logprobs(
    logits_local: torch.Tensor, targets: torch.Tensor, group, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits_local [B, T, V/tp] (this rank's vocabulary slice), targets [B, T] or [B, T, K] (global
    ids; K candidates per position) -> (log p(target) shaped as targets, entropy [B, T] or None),
    equal on every tp rank."""
    z = logits_local.float()
    per_position = targets.dim() == z.dim() - 1
    targets = targets[..., None] if per_position else targets  # [B, T, K]
    width = z.shape[-1]
    start = dist.get_rank(group) * width
    m = z.detach().amax(-1, keepdim=True)  # [B, T, 1]
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = (z - m).exp()
    sumexp = _sum(e.sum(-1), group=group)  # [B, T]
    mine = (targets >= start) & (targets < start + width)
    local_idx = (targets - start).clamp(0, width - 1)
    z_target = z.gather(-1, local_idx) * mine  # [B, T, K]; 0 where another rank holds the target
    z_target = _sum(z_target, group=group)
    lse = m[..., 0] + sumexp.log()  # [B, T]
    logp = z_target - lse[..., None]
    logp = logp[..., 0] if per_position else logp
    entropy = None
    if with_entropy:
        pz = _sum((e * z).sum(-1), group=group) / sumexp  # Σ p·z
        entropy = lse - pz
    return logp, entropy


def head_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_group=None, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropies) [B, T] of `targets` from the head's logits [B, T, V], whole or,
    with `vocab_group`, this rank's vocabulary slice combined over the group."""
    if vocab_group is None:
        return logprobs_from_logits(logits, targets, temperature, with_entropy)
    return vocab_parallel_logprobs(scale_by_temperature(logits, temperature), targets, vocab_group, with_entropy)


def next_token_logprobs_at(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, cp=None, vocab_group=None, with_entropy=False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`head_logprobs` of each next token of `input_ids` [B, T] from the head's logits [B, T or t, V]:
    under context parallelism (`cp`) this rank's t positions, gathered into whole rows [B, T-1]."""
    logits = logits.float()  # slice after the head
    if cp is None:
        logits, targets = logits[:, :-1], input_ids[:, 1:]
    else:
        targets = cp.next_tokens(input_ids)
    logp, entropy = head_logprobs(logits, targets, temperature, vocab_group, with_entropy)
    if cp is not None:
        n = input_ids.shape[1] - 1
        logp = cp.gather(logp, n)
        entropy = cp.gather(entropy, n) if with_entropy else None
    return logp, entropy


@torch.no_grad()
def gather_vocab(logits_local: torch.Tensor, group) -> torch.Tensor:
    """[B, T, V/tp] slices of the head's output -> [B, T, V] on every tp rank (decoding: a few positions)."""
    parts = [torch.empty_like(logits_local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits_local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)
