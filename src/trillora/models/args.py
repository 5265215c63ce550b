"""The normalised architecture of a model, read from a Hugging Face `config.json`.

Config keys drift across transformers versions and model releases
(`num_experts` vs `num_local_experts` vs `n_routed_experts`, `rope_theta` /
`rope_scaling` vs `rope_parameters`, `model_type: kimi_k2`). Everything below
the loader reads one spelling: `ModelArgs`. The original dict is kept so that
a checkpoint saved back carries the user's config untouched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, MissingPath

# model_type -> family. Kimi K2 ships `model_type: kimi_k2` with the DeepSeek-V3 architecture.
FAMILIES: dict[str, str] = {
    "qwen3_moe": "qwen3_moe",
    "qwen3": "qwen3_moe",  # dense Qwen3: the no-expert case of the same family
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "glm4_moe": "glm4_moe",
    "gpt_oss": "gpt_oss",
}
ARCHITECTURES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3ForCausalLM": "qwen3",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
    "GptOssForCausalLM": "gpt_oss",
}


@dataclass(kw_only=True, frozen=True)
class RopeArgs:
    """Rotary embedding; `kind` is "default" or "yarn" (YaRN, arXiv:2309.00071)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(kw_only=True, frozen=True)
class ModelArgs:
    family: str  # "qwen3_moe" | "deepseek_v3" | "glm4_moe" | "gpt_oss"
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # GQA head size (Qwen3); for MLA the rope part
    intermediate_size: int  # dense MLP
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    attention_bias: bool = False  # on q, k and v (and on o where `attention_out_bias`)
    attention_out_bias: bool = False
    qk_norm: bool = True  # per-head RMSNorm on q and k (Qwen3 always; GLM-4.5 `use_qk_norm`)
    rotary_dim: int = 0  # GQA: rope on the first `rotary_dim` dims of each head (GLM's partial rotary); 0 = all
    rope: RopeArgs = field(default_factory=RopeArgs)
    # per layer: 0 = full causal attention, w = each query sees its last w keys (gpt-oss `layer_types`)
    layer_windows: tuple[int, ...] = ()
    attention_sinks: bool = False  # a learned per-head logit in every softmax's denominator (gpt-oss)
    # --- MoE ---
    num_experts: int = 0  # routed experts per MoE layer; 0 = dense model
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router: str = "softmax"  # "softmax" (Qwen3) | "sigmoid" (DeepSeek-V3 noaux_tc) | "topk_softmax" (gpt-oss)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    # which layers are MoE: Qwen3 uses decoder_sparse_step + mlp_only_layers, DeepSeek first_k_dense_replace
    moe_layers: tuple[int, ...] = ()
    expert_bias: bool = False  # bias on every expert projection and on the router (gpt-oss)
    swiglu_limit: float = 0.0  # > 0: gpt-oss's clamped SwiGLU, (clamp(up) + 1) · g·σ(alpha·g) with g = clamp(gate)
    swiglu_alpha: float = 1.702
    # --- MLA (DeepSeek-V3) ---
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    num_mtp_layers: int = 0  # multi-token-prediction layers stored after the decoder; skipped on load
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and bool(self.moe_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def window(self, layer: int) -> int:
        """Sliding-window size of `layer`'s attention; 0 = full causal."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def rope_dim(self) -> int:
        """Dimensions of each head that rotate: MLA's rope part, or GQA's (partial) rotary span."""
        return self.qk_rope_head_dim if self.kv_lora_rank else (self.rotary_dim or self.head_dim)


def _get(cfg: dict, *names: str, default: Any = None, required: bool = False, where: str = "config.json") -> Any:
    for name in names:
        if name in cfg and cfg[name] is not None:
            return cfg[name]
    if required:
        raise ConfigError(f"{where}: missing required key {' / '.join(repr(n) for n in names)}")
    return default


def _rope_args(cfg: dict, where: str) -> RopeArgs:
    params = dict(cfg.get("rope_parameters") or {})
    if cfg.get("model_type") == "gpt_oss":
        if not params and not cfg.get("rope_scaling"):
            params = dict(GPT_OSS_ROPE)
        params.setdefault("rope_theta", cfg.get("rope_theta") or 150000.0)
    # nested per-layer-type rope parameters are not used by these families
    legacy = cfg.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(_get(params, "rope_theta", default=_get(cfg, "rope_theta", default=10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ConfigError(f"{where}: rope type {kind!r} is not supported; allowed: 'default', 'yarn'")
    if kind == "default":
        return RopeArgs(theta=theta)
    max_pos = int(_get(cfg, "max_position_embeddings", default=4096))
    original = int(params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings") or max_pos)
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


def model_type_of(cfg: dict, where: str = "config.json") -> str:
    model_type = cfg.get("model_type")
    if model_type in FAMILIES:
        return model_type
    if model_type is None:
        for arch in cfg.get("architectures") or []:
            if arch in ARCHITECTURES:
                return ARCHITECTURES[arch]
    raise ConfigError(
        f"{where}: model_type {model_type!r} is not supported; supported model types: {', '.join(sorted(FAMILIES))}"
    )


def from_hf_config(cfg: dict[str, Any], where: str = "config.json") -> ModelArgs:
    """Normalise a Hugging Face config dict (any of the spellings we know) into `ModelArgs`."""
    model_type = model_type_of(cfg, where)
    family = FAMILIES[model_type]
    req = dict(required=True, where=where)
    hidden = int(_get(cfg, "hidden_size", **req))
    heads = int(_get(cfg, "num_attention_heads", **req))
    layers = int(_get(cfg, "num_hidden_layers", **req))
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported; allowed: 'silu'")
    common = dict(
        model_type=model_type,
        family=family,
        vocab_size=int(_get(cfg, "vocab_size", **req)),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
        intermediate_size=int(_get(cfg, "intermediate_size", **req)),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", default=1e-5 if family == "gpt_oss" else 1e-6)),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", default=False)),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", default=4096)),
        attention_bias=bool(_get(cfg, "attention_bias", default=family == "gpt_oss")),
        rope=_rope_args(cfg, where),
        hf_config=dict(cfg),
    )
    num_experts = int(_get(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0))
    if family == "qwen3_moe":
        step = int(_get(cfg, "decoder_sparse_step", default=1))
        dense_only = set(_get(cfg, "mlp_only_layers", default=[]))
        moe_layers = tuple(
            i for i in range(layers) if num_experts > 0 and i not in dense_only and (i + 1) % step == 0
        )
        args = ModelArgs(
            **common,
            attention_out_bias=common["attention_bias"],
            head_dim=int(_get(cfg, "head_dim", default=hidden // heads)),
            num_experts=num_experts,
            top_k=int(_get(cfg, "num_experts_per_tok", default=0 if num_experts == 0 else 1)),
            moe_intermediate_size=int(_get(cfg, "moe_intermediate_size", default=0)),
            norm_topk_prob=bool(_get(cfg, "norm_topk_prob", default=False)),
            router="softmax",
            moe_layers=moe_layers,
        )
    elif family == "glm4_moe":  # GQA (q/k/v bias, optional q/k norm, partial rotary) + DeepSeek-V3's MoE
        head_dim = int(_get(cfg, "head_dim", default=hidden // heads))
        factor = float(_get(cfg.get("rope_parameters") or {}, "partial_rotary_factor",
                            default=_get(cfg, "partial_rotary_factor", default=1.0)))
        args = ModelArgs(
            **common,
            head_dim=head_dim,
            qk_norm=bool(_get(cfg, "use_qk_norm", default=False)),
            rotary_dim=int(head_dim * factor),
            **_sigmoid_moe(cfg, layers, num_experts, where),
            num_mtp_layers=int(_get(cfg, "num_nextn_predict_layers", default=0)),
        )
    elif family == "gpt_oss":
        args = ModelArgs(**common, **_gpt_oss(cfg, layers, num_experts, where))
    else:
        rope_dim = int(_get(cfg, "qk_rope_head_dim", **req))
        q_lora = cfg.get("q_lora_rank")
        args = ModelArgs(
            **common,
            head_dim=rope_dim,
            **_sigmoid_moe(cfg, layers, num_experts, where),
            q_lora_rank=int(q_lora) if q_lora is not None else None,
            kv_lora_rank=int(_get(cfg, "kv_lora_rank", **req)),
            qk_nope_head_dim=int(_get(cfg, "qk_nope_head_dim", **req)),
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(_get(cfg, "v_head_dim", **req)),
            rope_interleave=bool(_get(cfg, "rope_interleave", default=True)),
            num_mtp_layers=int(_get(cfg, "num_nextn_predict_layers", "num_mtp_layers", default=0)),
        )
    validate(args, where)
    return args


def _sigmoid_moe(cfg: dict, layers: int, num_experts: int, where: str) -> dict[str, Any]:
    """DeepSeek-V3's MoE as GLM-4.5 shares it: sigmoid scores with a selection bias, group-limited
    top-k, a scaling factor, shared experts, the first `first_k_dense_replace` layers dense."""
    scoring = cfg.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"{where}: scoring_func {scoring!r} is not supported; allowed: 'sigmoid'")
    first_dense = int(_get(cfg, "first_k_dense_replace", default=0))
    freq = int(_get(cfg, "moe_layer_freq", default=1))
    return dict(
        num_experts=num_experts,
        top_k=int(_get(cfg, "num_experts_per_tok", required=True, where=where)),
        moe_intermediate_size=int(_get(cfg, "moe_intermediate_size", required=True, where=where)),
        norm_topk_prob=bool(_get(cfg, "norm_topk_prob", default=True)),
        router="sigmoid",
        n_group=int(_get(cfg, "n_group", default=1)),
        topk_group=int(_get(cfg, "topk_group", default=1)),
        routed_scaling_factor=float(_get(cfg, "routed_scaling_factor", default=1.0)),
        n_shared_experts=int(_get(cfg, "n_shared_experts", default=0)),
        moe_layers=tuple(i for i in range(layers) if num_experts > 0 and i >= first_dense and i % freq == 0),
    )


GPT_OSS_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096)
"""What transformers assumes when a gpt-oss config.json names no rope parameters."""


def _gpt_oss(cfg: dict, layers: int, num_experts: int, where: str) -> dict[str, Any]:
    """gpt-oss: GQA with bias on q, k, v and o, no q/k norm, attention sinks, every other layer
    a sliding window (`layer_types`); every layer MoE, routed by a softmax over the top-k logits
    of a biased router, experts with biases and the clamped SwiGLU."""
    window = int(_get(cfg, "sliding_window", default=128) or 0)
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ConfigError(f"{where}: layer_types has {len(types)} entries for num_hidden_layers={layers}")
    for i, kind in enumerate(types):
        if kind not in ("sliding_attention", "full_attention"):
            raise ConfigError(f"{where}: layer_types[{i}] = {kind!r}; allowed: 'sliding_attention', 'full_attention'")
    inter = int(_get(cfg, "intermediate_size", required=True, where=where))
    return dict(
        head_dim=int(_get(cfg, "head_dim", default=cfg["hidden_size"] // cfg["num_attention_heads"])),
        attention_out_bias=bool(_get(cfg, "attention_bias", default=True)),
        qk_norm=False,
        layer_windows=tuple(window if kind == "sliding_attention" else 0 for kind in types),
        attention_sinks=True,
        num_experts=num_experts,
        top_k=int(_get(cfg, "num_experts_per_tok", "experts_per_token", required=True, where=where)),
        moe_intermediate_size=inter,
        router="topk_softmax",
        moe_layers=tuple(range(layers)) if num_experts else (),
        expert_bias=True,
        swiglu_limit=float(_get(cfg, "swiglu_limit", default=7.0)),
        swiglu_alpha=float(_get(cfg, "swiglu_alpha", default=1.702)),
    )


def validate(args: ModelArgs, where: str = "config.json") -> None:
    def fail(msg: str) -> None:
        raise ConfigError(f"{where}: {msg}")

    if args.num_heads % args.num_kv_heads:
        fail(f"num_attention_heads={args.num_heads} is not a multiple of num_key_value_heads={args.num_kv_heads}")
    if args.is_moe:
        if not 0 < args.top_k <= args.num_experts:
            fail(f"num_experts_per_tok={args.top_k} must be in 1..{args.num_experts} (the number of experts)")
        if args.moe_intermediate_size <= 0:
            fail("moe_intermediate_size must be positive for a model with experts")
        if args.router == "sigmoid":
            if args.num_experts % args.n_group:
                fail(f"n_routed_experts={args.num_experts} is not divisible by n_group={args.n_group}")
            if not 0 < args.topk_group <= args.n_group:
                fail(f"topk_group={args.topk_group} must be in 1..n_group={args.n_group}")
            if args.n_group > 1 and args.num_experts // args.n_group < 2:
                fail("grouped routing scores each group by its top-2 experts: need at least 2 experts per group")


def load_hf_config(path: str | Path) -> tuple[ModelArgs, dict[str, Any]]:
    """Read `config.json` (or a folder holding it) into (ModelArgs, raw dict)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise MissingPath(f"no config.json at {file}")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    return from_hf_config(raw, where=str(file)), raw
