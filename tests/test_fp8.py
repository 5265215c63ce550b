"""FP8 block-quantised checkpoints (DeepSeek-V3 / Kimi K2 release format)."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import DEEPSEEK_V3, hf_model, save_fused, tokens
from safetensors.torch import save_file

import trillora
from trillora.checkpoint import dequantize_blockwise, quantize_blockwise


def test_dequantize_by_hand():
    # 3x3 weight, 2x2 blocks -> scale grid 2x2: each value times the scale of its block
    w = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]).to(torch.float8_e4m3fn)
    s = torch.tensor([[1.0, 10.0], [100.0, 0.5]])
    expect = torch.tensor([[1.0, 2.0, 30.0], [4.0, 5.0, 60.0], [700.0, 800.0, 4.5]])
    assert torch.equal(dequantize_blockwise(w, s, block=2), expect)


def test_dequantize_equals_transformers_block_dequantisation():
    """The oracle is transformers' own loader op (`Fp8Dequantize`, what `dequantize=True` runs on a
    DeepSeek-V3 / Kimi K2 release), not our quantizer: every fp8 value in 128x128 blocks."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 384, generator=g) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3, generator=g) * 1e-2 + 1e-4  # weight_scale_inv: one per block
    want = Fp8Dequantize(None)._dequantize_one(w, s, torch.float32)
    assert torch.equal(dequantize_blockwise(w, s, block=128), want)


def test_dequantize_rejects_wrong_scale_shape():
    with pytest.raises(ValueError, match=r"expected \(2, 1\)"):
        dequantize_blockwise(torch.zeros(3, 2, dtype=torch.float8_e4m3fn), torch.ones(1, 1), block=2)


def test_quantize_roundtrip_is_close():
    w = torch.randn(70, 45)
    q, s = quantize_blockwise(w, block=16)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 3)
    back = dequantize_blockwise(q, s, block=16)
    assert ((back - w).abs() / w.abs().clamp(min=1e-2)).median() < 0.07  # e4m3 has a 3-bit mantissa


QUANTISED = ("_proj.weight",)  # every projection (attention, dense MLP, shared and routed experts)


@pytest.mark.parametrize("block", [128, 16])
def test_fp8_checkpoint_matches_dequantised_reference(tmp_path, block):
    """Written blockwise-quantised over two shards (scales apart from weights), with an MTP layer to skip."""
    hf = hf_model(DEEPSEEK_V3)
    src = trillora.load_model(save_fused(hf, tmp_path / "src"))
    per_expert = trillora.checkpoint.hf_state_dict(src, expert_layout="per_expert")
    shard_a, shard_b, reference = {}, {}, {}
    for name, t in per_expert.items():
        if name.endswith(QUANTISED) and t.dim() == 2:
            q, s = quantize_blockwise(t, block)
            shard_a[name] = q
            shard_b[name + "_scale_inv"] = s  # the scale lives in the other shard
            reference[name] = dequantize_blockwise(q, s, block)
        else:
            shard_a[name] = t
            reference[name] = t
    n = DEEPSEEK_V3["num_hidden_layers"]
    mtp = {f"model.layers.{n}.eh_proj.weight": torch.randn(64, 128), f"model.layers.{n}.enorm.weight": torch.ones(64)}
    shard_b.update(mtp)
    out = tmp_path / "fp8"
    out.mkdir()
    save_file(shard_a, str(out / "model-00001-of-00002.safetensors"))
    save_file(shard_b, str(out / "model-00002-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in shard_a}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in shard_b})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = dict(hf.config.to_dict(), num_nextn_predict_layers=1)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    (out / "config.json").write_text(json.dumps(config))

    got = trillora.load_model(out)
    want = trillora.load_model(_write(reference, hf, tmp_path / "dequantised"))
    for (k, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    from test_checkpoint import assert_expert_slice

    assert_expert_slice(trillora.load_model(out, experts=(1, 2)), want, 1, 2)  # others' weights and scales unread
    ids = tokens(hf.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(got(ids), want(ids))
        assert (got(ids) - src(ids)).abs().max() > 1e-4  # quantisation really changed the weights


def _write(tensors, hf, path):
    path.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    return path
