"""What every rollout engine takes and returns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, get_args

import torch
from torch import nn

EngineName = Literal["local", "vllm", "openai"]
"""`local`: the built-in engine in this process; `vllm`: vLLM's LLM in this process; `openai`:
OpenAI-compatible servers (vLLM, SGLang, `trillora serve`)."""
SyncMode = Literal["auto", "adapter", "merged"]
Precision = Literal["auto", "fp32", "bf16_weights", "bf16", "policy"]
"""Rollout weights: bf16 on GPU / bf16-rounded fp32 on CPU (`auto`), fp32, bf16-rounded fp32, bf16 (a
merged copy of the policy each), or the policy itself (`policy`: no copy, adapters unmerged)."""
PRECISIONS: tuple[str, ...] = get_args(Precision)


@dataclass(kw_only=True, frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = no top-k filter."""
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    return_routing: bool = False
    """Keep the experts each input token was routed to (for router replay)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}; must be >= 1")
        if not (self.temperature == 0 or 1e-5 <= self.temperature < math.inf):  # NaN fails too
            raise ValueError(f"temperature={self.temperature}; must be 0 (greedy) or in [1e-5, inf)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}; must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}; must be >= 0")

    def requests(self, prompts: list[list[int]], n: int) -> list[list[tuple[list[int], int, SamplingParams]]]:
        """Per prompt, the (prompt, samples, params) requests of an external server that sample its n
        completions: one request of n, or with a seed n requests of one seeded seed + i·n + j (vLLM
        gives every sample of a seeded n>1 request the same tokens)."""
        if self.seed is None:
            return [[(p, n, self)] for p in prompts]
        return [[(p, 1, replace(self, seed=self.seed + i * n + j)) for j in range(n)] for i, p in enumerate(prompts)]


@dataclass(kw_only=True)
class Completion:
    """One sampled continuation.

    `logprobs[i]` is log softmax(logits / temperature)[token_ids[i]] over the *full* vocabulary,
    before any top-k / top-p truncation: the quantity the trainer recomputes, so the two
    differ only by engine numerics (with truncation, the sampling distribution itself is
    the renormalised truncated one; the mismatch correction then also covers that).
    Greedy decoding reports log softmax(logits) (temperature 1).
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token, included) | "length"
    routed_experts: torch.Tensor | None = field(default=None, repr=False)
    """[prompt + completion - 1 input tokens, MoE layers, top-k]: routing of every token fed to the model."""


class RolloutEngine(Protocol):
    returns_routing: bool
    """Whether `SamplingParams.return_routing` is honoured (the routed experts of every token)."""

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """n completions for each prompt (token ids), grouped by prompt."""

    def sync(self, model: nn.Module) -> dict[str, float]:
        """Bring the engine's weights up to date with the trainer's; returns what it cost."""

    def pinned(self):
        """A `generate` bound to the current weights that a sync does not disturb (an engine keeping
        several adapter revisions loaded), or None when syncs rewrite the weights in place."""

    def close(self) -> None: ...
