"""DeepSeek-V3's config.json (Kimi K2 ships the same keys under `model_type: kimi_k2`): multi-head
latent attention, and the MoE that GLM-4.5 shares (`sigmoid_moe`)."""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from ..args import ModelArgs
from ..config_keys import get


def parse(cfg: dict[str, Any], common: dict[str, Any], where: str) -> ModelArgs:
    req = dict(required=True, where=where)
    rope_dim = int(get(cfg, "qk_rope_head_dim", **req))
    q_lora = cfg.get("q_lora_rank")
    return ModelArgs(
        **common,
        head_dim=rope_dim,
        **sigmoid_moe(cfg, common, where),
        q_lora_rank=int(q_lora) if q_lora is not None else None,
        kv_lora_rank=int(get(cfg, "kv_lora_rank", **req)),
        qk_nope_head_dim=int(get(cfg, "qk_nope_head_dim", **req)),
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(get(cfg, "v_head_dim", **req)),
        rope_interleave=bool(get(cfg, "rope_interleave", default=True)),
        num_mtp_layers=int(get(cfg, "num_nextn_predict_layers", "num_mtp_layers", default=0)),
    )


def sigmoid_moe(cfg: dict[str, Any], common: dict[str, Any], where: str) -> dict[str, Any]:
    """Sigmoid scores with a selection bias, group-limited top-k, a scaling factor, shared experts,
    the first `first_k_dense_replace` layers dense."""
    scoring = cfg.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"{where}: scoring_func {scoring!r} is not supported; allowed: 'sigmoid'")
    layers, num_experts = common["num_layers"], common["num_experts"]
    first_dense = int(get(cfg, "first_k_dense_replace", default=0))
    freq = int(get(cfg, "moe_layer_freq", default=1))
    return dict(
        top_k=int(get(cfg, "num_experts_per_tok", required=True, where=where)),
        moe_intermediate_size=int(get(cfg, "moe_intermediate_size", required=True, where=where)),
        norm_topk_prob=bool(get(cfg, "norm_topk_prob", default=True)),
        router="sigmoid",
        n_group=int(get(cfg, "n_group", default=1)),
        topk_group=int(get(cfg, "topk_group", default=1)),
        routed_scaling_factor=float(get(cfg, "routed_scaling_factor", default=1.0)),
        n_shared_experts=int(get(cfg, "n_shared_experts", default=0)),
        moe_layers=tuple(i for i in range(layers) if num_experts > 0 and i >= first_dense and i % freq == 0),
    )
