"""What to adapt and how: `LoraConfig`.

Targets are named by role so users need not know module paths:

| role             | modules                                                              |
|------------------|----------------------------------------------------------------------|
| `attention`      | GQA q/k/v/o_proj; MLA q_proj or q_a/q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj |
| `mlp`            | dense SwiGLU layers' gate/up/down_proj                               |
| `shared_experts` | DeepSeek-V3 shared experts' gate/up/down_proj                        |
| `experts`        | routed experts (stacked gate, up and down adapters)                  |
| `router`         | the router's weight (off by default)                                 |
| `lm_head`        | the output head (off by default)                                     |

`patterns` adds any other linear layer by glob over module names; `exclude` removes by glob.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from ..errors import ConfigError

ROLES = ("attention", "mlp", "shared_experts", "experts", "router", "lm_head")
DEFAULT_TARGETS = ("attention", "mlp", "shared_experts", "experts")
LoraInit = Literal["kaiming", "gaussian"]
ExpertRankRule = Literal["same", "divide_by_top_k"]
AdapterDtype = Literal["float32", "bfloat16", "float16"]
INITS: tuple[str, ...] = get_args(LoraInit)
EXPERT_RANK_RULES: tuple[str, ...] = get_args(ExpertRankRule)
DTYPES = {name: getattr(torch, name) for name in get_args(AdapterDtype)}


class LoraConfigError(ConfigError):
    """A LoRA setting out of range; the message names the key and the allowed values."""


@dataclass(kw_only=True, frozen=True)
class LoraConfig:
    rank: int = 8
    """Rank of dense adapters (and of expert adapters unless `expert_rank` / `expert_rank_rule` say otherwise)."""
    alpha: float = 16.0
    """Scaling numerator: the update is (alpha / rank) · B·A, or alpha / sqrt(rank) with `rslora`."""
    rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(rank) (Kalajdzievski 2023, arXiv:2312.03732)."""
    dropout: float = 0.0
    """Dropout on the adapter's input, training only."""
    init: LoraInit = "kaiming"
    """A initialised kaiming-uniform (as PEFT) or gaussian(0, 1/rank); B always starts at zero."""
    targets: tuple[str, ...] = DEFAULT_TARGETS
    patterns: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    expert_rank: int | None = None
    """Explicit rank for routed-expert adapters."""
    expert_rank_rule: ExpertRankRule = "same"
    """`same`: expert rank = rank; `divide_by_top_k`: rank // top_k, so a token's experts add up to about one
    rank-r update. Expert adapters keep the dense scaling (alpha / rank) whatever their own rank."""
    dtype: AdapterDtype = "float32"
    """Adapter parameter dtype, independent of the (frozen) base's dtype."""
    seed: int = 0

    def __post_init__(self) -> None:
        def fail(key: str, value: object, allowed: str) -> None:
            raise LoraConfigError(f"lora.{key}={value!r} is invalid; allowed: {allowed}")

        if not isinstance(self.rank, int) or self.rank < 1:
            fail("rank", self.rank, "a positive integer")
        if self.expert_rank is not None and (not isinstance(self.expert_rank, int) or self.expert_rank < 1):
            fail("expert_rank", self.expert_rank, "a positive integer or None")
        if not 0.0 <= self.dropout < 1.0:
            fail("dropout", self.dropout, "0 <= dropout < 1")
        if self.alpha <= 0:
            fail("alpha", self.alpha, "a positive number")
        if self.init not in INITS:
            fail("init", self.init, ", ".join(INITS))
        if self.expert_rank_rule not in EXPERT_RANK_RULES:
            fail("expert_rank_rule", self.expert_rank_rule, ", ".join(EXPERT_RANK_RULES))
        if self.dtype not in DTYPES:
            fail("dtype", self.dtype, ", ".join(DTYPES))
        bad = [t for t in self.targets if t not in ROLES]
        if bad:
            fail("targets", bad[0], ", ".join(ROLES))

    def scaling(self, rank: int) -> float:
        return self.alpha / math.sqrt(rank) if self.rslora else self.alpha / rank

    def rank_for_experts(self, top_k: int) -> int:
        if self.expert_rank is not None:
            return self.expert_rank
        if self.expert_rank_rule == "divide_by_top_k":
            return max(1, self.rank // max(1, top_k))
        return self.rank

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
