"""The normalised architecture of a model: what every family's `config.py` reads its
Hugging Face `config.json` into, and the one spelling everything below the loader reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError


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
    family: str  # a registered family's name (`registry.FAMILIES`)
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
