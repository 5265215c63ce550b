"""Reducing per-token losses to a scalar over a *global* count, so that the gradient is the
same however the batch is split into minibatches or across data-parallel ranks.

Shape legend: B sequences, T tokens; mask [B, T] is 1 on completion tokens.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


def aggregate(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    global_tokens: float,
    global_seqs: float,
    norm_len: float = 1.0,
) -> torch.Tensor:
    """- `token_mean`: Σ loss / (completion tokens of the whole batch): long answers weigh more (DAPO).
    - `seq_mean_token_mean`: each sequence's token mean, averaged over the batch's sequences (GRPO paper).
    - `seq_mean_token_sum_norm`: Σ loss / (sequences · norm_len), a constant length (Dr. GRPO).
    `global_tokens` / `global_seqs` count the full batch, not this slice of it."""
    m = mask_BT.to(loss_BT.dtype)
    if mode == "token_mean":
        return (loss_BT * m).sum() / max(global_tokens, 1.0)
    if mode == "seq_mean_token_mean":
        per_seq = (loss_BT * m).sum(-1) / m.sum(-1).clamp(min=1.0)
        return per_seq.sum() / max(global_seqs, 1.0)
    if mode == "seq_mean_token_sum_norm":
        return (loss_BT * m).sum() / (max(global_seqs, 1.0) * norm_len)
    raise ValueError(f"loss aggregation {mode!r}; allowed: {', '.join(AGGREGATIONS)}")
