"""Qwen3-MoE's config.json (and dense Qwen3's, the no-expert case): which layers hold experts
follows `decoder_sparse_step` and `mlp_only_layers`; the output projection has a bias exactly
when q, k and v do."""

from __future__ import annotations

from typing import Any

from ..args import ModelArgs
from ..config_keys import get


def parse(cfg: dict[str, Any], common: dict[str, Any], where: str) -> ModelArgs:
    layers, num_experts = common["num_layers"], common["num_experts"]
    step = int(get(cfg, "decoder_sparse_step", default=1))
    dense_only = set(get(cfg, "mlp_only_layers", default=[]))
    return ModelArgs(
        **common,
        attention_out_bias=common["attention_bias"],
        head_dim=int(get(cfg, "head_dim", default=common["hidden_size"] // common["num_heads"])),
        top_k=int(get(cfg, "num_experts_per_tok", default=0 if num_experts == 0 else 1)),
        moe_intermediate_size=int(get(cfg, "moe_intermediate_size", default=0)),
        norm_topk_prob=bool(get(cfg, "norm_topk_prob", default=False)),
        router="softmax",
        moe_layers=tuple(i for i in range(layers) if num_experts > 0 and i not in dense_only and (i + 1) % step == 0),
    )
