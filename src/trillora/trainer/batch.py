"""The trainer's batch: sampled rows as tensors, and the slices of it each rank and pass trains on.

Rows are right-padded prompt + completion; position t of every [B, T-1] tensor is the prediction
of token t+1. Shape legend: B rows, T tokens, L MoE layers, K experts per token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..envs.trajectory import Sample


@dataclass(kw_only=True)
class TokenBatch:
    input_ids: torch.Tensor  # [B, T] prompt + completion, right-padded
    completion_mask: torch.Tensor  # [B, T-1]: 1 where target token t+1 is a completion token
    rollout_logprobs: torch.Tensor  # [B, T-1] engine logprobs aligned with the mask (0 elsewhere)
    prompt_lengths: torch.Tensor | None = None  # [B] tokens of each row's prompt
    routes: torch.Tensor | None = None  # [B, T, L, K] experts the engine chose per input token (int16)
    routes_valid: torch.Tensor | None = None  # [B, T] True where the engine fed that token (all but the last)
    advantages: torch.Tensor | None = None  # [B] each row's advantage (group-relative, set after the rewards)
    group_size: int | None = None
    """Rows come in groups of this many consecutive rows sharing one prompt (a GRPO group of single-turn
    samples), which lets the passes run each prompt once; None when they do not."""

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> TokenBatch:
        """The batch of `rows` (indices [b]): every per-row field sliced alike, whatever fields exist."""
        if len(rows) == self.num_rows and torch.equal(rows.cpu(), torch.arange(self.num_rows)):
            return self
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return TokenBatch(**{k: v[rows.to(v.device)] if torch.is_tensor(v) else v for k, v in fields.items()})


def batch_from_samples(samples: list[Sample], pad_id: int = 0, device: torch.device | str = "cpu") -> TokenBatch:
    """Training rows of token sequences with loss masks (`trillora.envs.trajectory`), right-padded."""
    width = max(len(s.tokens) for s in samples)
    for i, s in enumerate(samples):
        if not len(s.tokens) == len(s.mask) == len(s.logprobs):
            raise ValueError(
                f"sample {i}: {len(s.tokens)} tokens, {len(s.mask)} mask values, {len(s.logprobs)} logprobs"
            )
    # padded as lists, one tensor per field (a tensor per row costs more than the rows' numbers);
    # target position j predicts token j+1: a trained token at k is predicted at k-1
    ids = torch.tensor([list(s.tokens) + [pad_id] * (width - len(s.tokens)) for s in samples], dtype=torch.long)
    mask = torch.tensor([list(s.mask[1:]) + [0.0] * (width - len(s.tokens)) for s in samples], dtype=torch.float32)
    lps = torch.tensor([list(s.logprobs[1:]) + [0.0] * (width - len(s.tokens)) for s in samples], dtype=torch.float32)
    return TokenBatch(
        input_ids=ids.to(device),
        completion_mask=mask.to(device),
        rollout_logprobs=lps.to(device),
        prompt_lengths=torch.tensor([s.prompt_length for s in samples], device=device),
    )


def with_routes(batch: TokenBatch, routes: list[torch.Tensor]) -> TokenBatch:
    """The batch with each row's recorded routing [tokens fed to the engine, L, K] laid out as [B, T, L, K]."""
    b, width = batch.input_ids.shape
    layers, k = routes[0].shape[1:]
    table = torch.zeros(b, width, layers, k, dtype=torch.int16)
    valid = torch.zeros(b, width, dtype=torch.bool)
    for i, r in enumerate(routes):
        table[i, : r.shape[0]] = r.to(torch.int16)
        valid[i, : r.shape[0]] = True
    device = batch.input_ids.device
    return dataclasses.replace(batch, routes=table.to(device), routes_valid=valid.to(device))


def completion_spans(batch: TokenBatch, rows: torch.Tensor) -> torch.Tensor:
    """[b] positions from each row's prompt end to its last trained token: the completion a shared-
    prompt pass runs (observation tokens between a multi-turn sample's actions included)."""
    mask = batch.completion_mask[rows]  # [b, T-1]
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    last = (positions * (mask > 0)).amax(-1)  # [b] one past the last trained target position
    return (last - (batch.prompt_lengths[rows].to(mask.device) - 1)).clamp(min=0).long()
