"""Reading a Hugging Face `config.json`: the keys every family shares, and the helpers each
family's `config.py` reads its own keys with.

Config keys drift across transformers versions and model releases (`num_experts` vs
`num_local_experts` vs `n_routed_experts`, `rope_theta` / `rope_scaling` vs `rope_parameters`).
Everything below the loader reads one spelling: `ModelArgs`.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .args import RopeArgs


def get(cfg: dict, *names: str, default: Any = None, required: bool = False, where: str = "config.json") -> Any:
    """The first of `names` that `cfg` sets (not to null), else `default`; `required` names them all."""
    for name in names:
        if name in cfg and cfg[name] is not None:
            return cfg[name]
    if required:
        raise ConfigError(f"{where}: missing required key {' / '.join(repr(n) for n in names)}")
    return default


def rope_args(cfg: dict, where: str) -> RopeArgs:
    params = dict(cfg.get("rope_parameters") or {})
    # nested per-layer-type rope parameters are not used by these families
    legacy = cfg.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(get(params, "rope_theta", default=get(cfg, "rope_theta", default=10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ConfigError(f"{where}: rope type {kind!r} is not supported; allowed: 'default', 'yarn'")
    if kind == "default":
        return RopeArgs(theta=theta)
    max_pos = int(get(cfg, "max_position_embeddings", default=4096))
    original = int(
        params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings") or max_pos
    )
    factor = params.get("factor")
    return RopeArgs(
        theta=theta,
        kind="yarn",
        factor=float(factor) if factor is not None else max_pos / original,
        original_max_position=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def common_keys(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """The `ModelArgs` fields every family reads the same way; a family's `parse` may override any."""
    req = dict(required=True, where=where)
    hidden = int(get(cfg, "hidden_size", **req))
    heads = int(get(cfg, "num_attention_heads", **req))
    layers = int(get(cfg, "num_hidden_layers", **req))
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported; allowed: 'silu'")
    return dict(
        vocab_size=int(get(cfg, "vocab_size", **req)),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(get(cfg, "num_key_value_heads", default=heads)),
        intermediate_size=int(get(cfg, "intermediate_size", **req)),
        rms_norm_eps=float(get(cfg, "rms_norm_eps", default=1e-6)),
        tie_word_embeddings=bool(get(cfg, "tie_word_embeddings", default=False)),
        max_position_embeddings=int(get(cfg, "max_position_embeddings", default=4096)),
        attention_bias=bool(get(cfg, "attention_bias", default=False)),
        rope=rope_args(cfg, where),
        num_experts=int(get(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0)),
        hf_config=dict(cfg),
    )
