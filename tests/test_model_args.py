"""config.json normalisation: every spelling we know reads the same; bad configs name the culprit."""

from __future__ import annotations

import json

import pytest
import transformers

from trillora.models import ConfigError, from_hf_config, load_hf_config
from trillora.models.params import shipped_config


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3", "qwen3-235b-a22b"])
def test_released_and_transformers_written_configs_agree(name):
    released = shipped_config(name)  # rope_theta/rope_scaling, num_experts / n_routed_experts
    cls = transformers.AutoConfig.for_model(released["model_type"]).__class__
    written = cls(**{k: v for k, v in released.items() if k != "quantization_config"}).to_dict()
    assert "rope_parameters" in written  # transformers 5 rewrote the rope keys
    a, b = from_hf_config(released), from_hf_config(written)
    assert a == b


def test_qwen3_num_local_experts_spelling():
    cfg = shipped_config("qwen3-30b-a3b")
    alt = dict(cfg)
    alt["num_local_experts"] = alt.pop("num_experts")
    assert from_hf_config(alt) == from_hf_config(cfg)
    assert from_hf_config(cfg).num_experts == 128 and len(from_hf_config(cfg).moe_layers) == 48


def test_kimi_k2_reads_as_deepseek_v3():
    args = from_hf_config(shipped_config("kimi-k2"))
    assert args.family == "deepseek_v3" and args.model_type == "kimi_k2"
    assert (args.num_experts, args.top_k, args.n_group, args.topk_group) == (384, 8, 1, 1)
    assert args.moe_layers == tuple(range(1, 61)) and args.routed_scaling_factor == 2.827
    assert args.rope.kind == "yarn" and args.rope.factor == 32.0 and args.rope.original_max_position == 4096
    only_arch = {k: v for k, v in shipped_config("kimi-k2").items() if k != "model_type"}
    assert from_hf_config(only_arch).family == "deepseek_v3"


def test_mlp_only_layers_and_sparse_step():
    cfg = dict(shipped_config("qwen3-30b-a3b"), num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert from_hf_config(cfg).moe_layers == (1, 5)
    dense = dict(shipped_config("qwen3-30b-a3b"), model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    dense.pop("num_experts")
    assert not from_hf_config(dense).is_moe


def test_gpt_oss_windows_and_their_errors():
    cfg = shipped_config("gpt-oss-20b")
    args = from_hf_config(cfg)
    assert args.layer_windows[:4] == (128, 0, 128, 0) and args.router == "topk_softmax" and args.rope.kind == "yarn"
    assert (args.rope.theta, args.rope.factor, args.rope.truncate) == (150000.0, 32.0, False)
    bare = {k: v for k, v in cfg.items() if k not in ("layer_types", "rope_scaling", "rope_theta")}
    assert from_hf_config(bare) == args  # transformers' defaults for a config that names none of these
    with pytest.raises(
        ConfigError, match=r"layer_types\[1\] = 'chunked_attention'; allowed: 'sliding_attention', 'full_attention'"
    ):
        from_hf_config(dict(cfg, layer_types=["sliding_attention", "chunked_attention"] + cfg["layer_types"][2:]))
    with pytest.raises(ConfigError, match="layer_types has 2 entries for num_hidden_layers=24"):
        from_hf_config(dict(cfg, layer_types=["sliding_attention", "full_attention"]))


def test_unsupported_model_type_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(
        ConfigError,
        match=r"config\.json: model_type 'llama' is not supported; supported model types: deepseek_v3, glm4_moe, "
        r"gpt_oss, kimi_k2, qwen3, qwen3_moe",
    ):
        load_hf_config(tmp_path)


def test_missing_key_names_file_and_key(tmp_path):
    cfg = shipped_config("deepseek-v3")
    del cfg["kv_lora_rank"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=rf"{tmp_path}/config.json: missing required key 'kv_lora_rank'"):
        load_hf_config(tmp_path)


def test_invalid_json_names_line(tmp_path):
    (tmp_path / "config.json").write_text('{\n  "model_type": "qwen3_moe",\n  "hidden_size": ,\n}')
    with pytest.raises(ConfigError, match="invalid JSON at line 3"):
        load_hf_config(tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"num_experts_per_tok": 9, "n_routed_experts": 8, "n_group": 1, "topk_group": 1},
            "num_experts_per_tok=9 must be in 1..8",
        ),
        ({"n_group": 7}, "n_routed_experts=256 is not divisible by n_group=7"),
        ({"topk_group": 9}, "topk_group=9 must be in 1..n_group=8"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported; allowed: 'silu'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic' is not supported"),
    ],
)
def test_impossible_values_are_named(change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_hf_config(dict(shipped_config("deepseek-v3"), **change))
