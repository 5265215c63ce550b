"""`trillora info`: counts from the meta-device module tree against hand formulas and published figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trillora.models.params import SHIPPED_CONFIGS, count_params, resolve_args


def hand_count(a) -> tuple[int, int]:
    """(total, activated) written out from the architecture, independently of the modules."""
    h, v = a.hidden_size, a.vocab_size
    if a.family == "deepseek_v3":
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        attn = h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * a.num_heads * qk
        attn += h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
        attn += a.kv_lora_rank * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim) + a.num_heads * a.v_head_dim * h
    else:
        d = a.head_dim
        attn = h * a.num_heads * d + 2 * h * a.num_kv_heads * d + a.num_heads * d * h
        attn += 2 * d if a.qk_norm else 0  # q/k norms (Qwen3; GLM-4.5 but not Air)
        attn += (a.num_heads + 2 * a.num_kv_heads) * d if a.attention_bias else 0  # GLM: q/k/v bias
        attn += h if a.attention_out_bias else 0
        attn += a.num_heads if a.attention_sinks else 0  # gpt-oss: one sink logit per head
    expert = 3 * h * a.moe_intermediate_size
    expert += 2 * a.moe_intermediate_size + h if a.expert_bias else 0  # gpt-oss: gate/up and down biases
    total = activated = v * h * 2 + h  # embedding, head, final norm
    for layer in range(a.num_layers):
        fixed = attn + 2 * h
        if layer in a.moe_layers:
            fixed += a.num_experts * (h + a.expert_bias) + a.n_shared_experts * expert  # router (+ its bias)
            total += fixed + a.num_experts * expert
            activated += fixed + a.top_k * expert
        else:
            total += fixed + 3 * h * a.intermediate_size
            activated += fixed + 3 * h * a.intermediate_size
    return total, activated


@pytest.mark.parametrize("name", SHIPPED_CONFIGS)
def test_counts_equal_hand_formula(name):
    args = resolve_args(name)
    c = count_params(args)
    assert (c.total, c.activated) == hand_count(args)


# Published figures: DeepSeek-V3 report 671B / 37B; Qwen3 cards 30.5B / 3.3B and 235B / 22B;
# Kimi K2 paper 1.04T / 32B (its model card says 1T / 32B). Our exact counts from the released
# configs: Kimi K2 1.026T (1.3% under 1.04T) and 32.9B activated with embeddings.
PUBLISHED = {
    "deepseek-v3": (671e9, 0.01, 37e9, 0.02),
    "kimi-k2": (1.04e12, 0.015, 32e9, 0.03),
    "qwen3-30b-a3b": (30.5e9, 0.01, 3.3e9, 0.02),
    "qwen3-235b-a22b": (235e9, 0.01, 22e9, 0.01),
    # GLM-4.5 cards 355B / 32B and 106B / 12B; they count active parameters without the embeddings
    # (ours: 352.8B / 32.08B and 106.9B / 12.18B; 355B likely includes the MTP layer we skip)
    "glm-4.5": (355e9, 0.01, 32e9, 0.01),
    "glm-4.5-air": (106e9, 0.01, 12e9, 0.02),
    # gpt-oss model card: 116.83B / 5.13B and 20.91B / 3.61B, active counting the unembedding but not the
    # embedding; ours are exactly these (116,829,156,672 and 20,914,757,184 in all)
    "gpt-oss-120b": (116.83e9, 0.0005, 5.13e9, 0.001),
    "gpt-oss-20b": (20.91e9, 0.0005, 3.61e9, 0.001),
}


@pytest.mark.parametrize("name", SHIPPED_CONFIGS)
def test_counts_near_published(name):
    c = count_params(resolve_args(name))
    total, tol_t, act, tol_a = PUBLISHED[name]
    args = resolve_args(name)
    activated = (
        c.activated - c.embeddings
        if name.startswith("glm")
        else c.activated - args.vocab_size * args.hidden_size
        if name.startswith("gpt-oss")
        else c.activated
    )
    assert abs(c.total / total - 1) < tol_t
    assert abs(activated / act - 1) < tol_a


def test_gpt_oss_as_released():
    """The MXFP4 release: routed-expert matrices at 4.25 bits, the rest bf16 (published files: 65.3 GB, 13.8 GB)."""
    for name, published in (("gpt-oss-120b", 65.3e9), ("gpt-oss-20b", 13.8e9)):
        c = count_params(resolve_args(name))
        assert abs(c.bytes_mxfp4_experts() / published - 1) < 0.01
    out = subprocess.run(
        [sys.executable, "-m", "trillora", "info", "gpt-oss-20b", "--json"], capture_output=True, text=True, check=True
    )
    info = json.loads(out.stdout)
    assert info["bytes_mxfp4_experts"] == count_params(resolve_args("gpt-oss-20b")).bytes_mxfp4_experts()
    assert info["structure"]["attention"].endswith("learned sinks; sliding window 128 on 12 of 24 layers")
    assert info["structure"]["experts"] == "32 routed (top-4, hidden 2880), with biases, SwiGLU clamped at 7"


def test_sizes_bf16_and_fp8():
    c = count_params(resolve_args("kimi-k2"))
    assert c.bytes_bf16() == 2 * c.total
    # fp8 is a little over one byte per projection weight: between 50% and 52% of bf16 here
    assert 0.50 < c.bytes_fp8() / c.bytes_bf16() < 0.52


@pytest.mark.slow
def test_info_cli_on_bare_config(tmp_path):
    from trillora.models.params import shipped_config

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(shipped_config("kimi-k2")))
    out = subprocess.run(
        [sys.executable, "-m", "trillora", "info", str(cfg), "--json"], capture_output=True, text=True, check=True
    )
    info = json.loads(out.stdout)
    assert info["total_params"] == count_params(resolve_args("kimi-k2")).total
    assert info["structure"]["experts"].startswith("384 routed (top-8")
    table = subprocess.run(
        [sys.executable, "-m", "trillora", "info", "deepseek-v3"], capture_output=True, text=True, check=True
    )
    assert "671.03B" in table.stdout and "MTP layers" in table.stdout


def test_info_cli_unknown_model_is_one_line_error():
    out = subprocess.run([sys.executable, "-m", "trillora", "info", "gpt-5"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "gpt-5: neither a config.json" in out.stderr and "Traceback" not in out.stderr


def test_info_cli_sizes_a_lora_adapter():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "trillora",
            "info",
            "kimi-k2",
            "--json",
            "--lora-rank",
            "128",
            "--expert-rank-rule",
            "divide_by_top_k",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    info = json.loads(out.stdout)["lora"]
    assert 0.0100 < info["fraction"] < 0.0112 and info["adapter_bytes"] == 4 * info["adapter_params"]
