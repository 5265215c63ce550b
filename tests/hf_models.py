"""Small random Hugging Face models used as oracles (transformers builds and saves them)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

QWEN3_MOE = dict(
    model_type="qwen3_moe",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
    max_position_embeddings=512,
)
QWEN3_MOE_YARN = dict(
    QWEN3_MOE,
    norm_topk_prob=False,
    mlp_only_layers=[],
    max_position_embeddings=128,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32),
)
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=1280,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        original_max_position_embeddings=32,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)
# Kimi K2's real ratios (hidden 7168 -> 112: q_lora 1536 -> 24, kv_lora 512 -> 8, MoE 2048 -> 32,
# dense 18432 -> 288), its router (n_group 1, topk_group 1, scaling 2.827, one shared expert,
# first layer dense) and YaRN (theta 50000, factor 32, beta 1/1, mscale 1/1); fewer layers and experts.
KIMI_K2_SHAPED = dict(
    model_type="deepseek_v3",
    vocab_size=160,
    hidden_size=112,
    intermediate_size=288,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=8,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=24,
    num_experts_per_tok=4,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    n_shared_experts=1,
    routed_scaling_factor=2.827,
    norm_topk_prob=True,
    max_position_embeddings=1024,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=50000.0,
        factor=32.0,
        original_max_position_embeddings=32,
        beta_fast=1.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)
# GLM-4.5's layout (q/k norm, q/k/v bias, rope on half of each 16-dim head, one shared expert,
# first layer dense, scaling 2.5, theta 1e6) at toy size; GLM-4.5-Air is the same without q/k norm
GLM4_MOE = dict(
    model_type="glm4_moe",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    attention_bias=True,
    use_qk_norm=True,
    max_position_embeddings=512,
    rope_parameters=dict(rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.5),
)
GLM4_MOE_AIR = dict(GLM4_MOE, use_qk_norm=False, routed_scaling_factor=1.0, n_group=2, topk_group=1)
# gpt-oss's layout (q/k/v/o bias, sinks, sliding window on even layers, biased router and experts,
# YaRN with truncate off) at toy size: 80-token sequences cross the 16-token window, and a swiglu
# limit of 0.5 clamps many gate and up values at these weights (7.0 in the release)
GPT_OSS = dict(
    model_type="gpt_oss",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=16,
    swiglu_limit=0.5,
    max_position_embeddings=256,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=8.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=32,
    ),
)
CONFIGS = {
    "qwen3_moe": QWEN3_MOE,
    "gpt_oss": GPT_OSS,
    "glm4_moe": GLM4_MOE,
    "glm4_moe_air": GLM4_MOE_AIR,
    "qwen3_moe_yarn": QWEN3_MOE_YARN,
    "deepseek_v3": DEEPSEEK_V3,
    "kimi_k2_shaped": KIMI_K2_SHAPED,
}


def hf_model(cfg: dict, seed: int = 0):
    """A transformers model (eager attention, fp32) with weights large enough that errors show."""
    import transformers

    cfg = dict(cfg)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("sinks"):  # large enough to take real mass from the softmax
                p.uniform_(-1.0, 2.0)
            else:
                p.normal_(0.0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    return model


def save_fused(model, path: Path) -> Path:
    """transformers 5's in-memory names (`experts.gate_up_proj`) written as they are."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(model.config.to_dict()))
    return path


def tokens(vocab: int, batch: int = 2, length: int = 80, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
