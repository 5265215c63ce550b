"""gpt-oss's config.json: GQA with bias on q, k, v and o, no q/k norm, attention sinks, every other
layer a sliding window (`layer_types`); every layer MoE, routed by a softmax over the top-k logits
of a biased router, experts with biases and the clamped SwiGLU. Its defaults differ from the other
families': rms_norm_eps 1e-5, attention bias on, and YaRN when the config names no rope."""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from ..args import ModelArgs
from ..config_keys import get, rope_args

ROPE = dict(
    rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096
)
"""What transformers assumes when a gpt-oss config.json names no rope parameters."""


def parse(cfg: dict[str, Any], common: dict[str, Any], where: str) -> ModelArgs:
    layers, num_experts = common["num_layers"], common["num_experts"]
    params = dict(cfg.get("rope_parameters") or {})
    if not params and not cfg.get("rope_scaling"):
        params = dict(ROPE)
    params.setdefault("rope_theta", cfg.get("rope_theta") or 150000.0)
    window = int(get(cfg, "sliding_window", default=128) or 0)
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ConfigError(f"{where}: layer_types has {len(types)} entries for num_hidden_layers={layers}")
    for i, kind in enumerate(types):
        if kind not in ("sliding_attention", "full_attention"):
            raise ConfigError(f"{where}: layer_types[{i}] = {kind!r}; allowed: 'sliding_attention', 'full_attention'")
    return ModelArgs(
        **{
            **common,
            "rms_norm_eps": float(get(cfg, "rms_norm_eps", default=1e-5)),
            "attention_bias": bool(get(cfg, "attention_bias", default=True)),
            "rope": rope_args({**cfg, "rope_parameters": params}, where),
            "head_dim": int(get(cfg, "head_dim", default=common["hidden_size"] // common["num_heads"])),
            "attention_out_bias": bool(get(cfg, "attention_bias", default=True)),
            "qk_norm": False,
            "layer_windows": tuple(window if kind == "sliding_attention" else 0 for kind in types),
            "attention_sinks": True,
            "top_k": int(get(cfg, "num_experts_per_tok", "experts_per_token", required=True, where=where)),
            "moe_intermediate_size": common["intermediate_size"],
            "router": "topk_softmax",
            "moe_layers": tuple(range(layers)) if num_experts else (),
            "expert_bias": True,
            "swiglu_limit": float(get(cfg, "swiglu_limit", default=7.0)),
            "swiglu_alpha": float(get(cfg, "swiglu_alpha", default=1.702)),
        }
    )
