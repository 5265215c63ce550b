"""MXFP4 experts (gpt-oss release format): dequantisation by hand and against transformers."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import GPT_OSS, hf_model, tokens
from safetensors.torch import save_file

import trillora
from trillora.checkpoint.hf import CheckpointError
from trillora.models.gpt_oss.mxfp4 import E2M1, dequantize_mxfp4


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N] (N a multiple of 32) -> (blocks, scales): the inverse of `dequantize_mxfp4` up to
    rounding to the nearest code: test checkpoints in the released format."""
    groups = w.float().reshape(*w.shape[:-1], -1, 32)  # [..., G, 32]
    top = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponent = (torch.floor(torch.log2(top)) - 2).clamp(-127, 127)  # largest |value| / 2^e lands in [4, 8)
    scaled = groups / torch.ldexp(torch.ones_like(top), exponent.int())[..., None]
    lut = torch.tensor(E2M1, dtype=torch.float32)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # nearest code; ties to the lower index
    codes = codes.view(*codes.shape[:-1], 16, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def test_dequantize_by_hand():
    # one group of 32 values: byte 0x21 holds codes 1 (0.5, low nibble first) and 2 (1.0);
    # 0xF8 holds 8 (-0.0) and 15 (-6.0); scale 128 = 2^1, scale 125 = 2^-2
    blocks = torch.full((2, 1, 16), 0x21, dtype=torch.uint8)
    blocks[1, 0, 0] = 0xF8
    scales = torch.tensor([[128], [125]], dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, scales)
    assert out.shape == (2, 32)
    assert out[0, :4].tolist() == [1.0, 2.0, 1.0, 2.0]
    assert out[1, :4].tolist() == [-0.0, -1.5, 0.125, 0.25]


def test_dequantize_equals_transformers():
    """Every byte value and a spread of exponents against transformers' own gpt-oss loader op."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.arange(256, dtype=torch.uint8).repeat(3 * 4 * 2 * 16 // 256 * 2)[: 3 * 4 * 2 * 16].view(3, 4, 2, 16)
    blocks = blocks[torch.randperm(3, generator=g)]
    scales = torch.randint(110, 140, (3, 4, 2), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]: transposed for its forward
    assert torch.equal(dequantize_mxfp4(blocks, scales), want.transpose(1, 2))


def test_dequantize_names_bad_shapes():
    with pytest.raises(ValueError, match=r"do not fit scales \(2, 3\)"):
        dequantize_mxfp4(torch.zeros(2, 2, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, dtype=torch.uint8))


def test_quantize_roundtrip_is_close():
    w = torch.randn(6, 64)
    back = dequantize_mxfp4(*quantize_mxfp4(w))
    # the group's largest |value| scales into [4, 8) and codes top out at 6: off by at most 2 of 8
    top = w.view(6, 2, 32).abs().amax(-1).repeat_interleave(32, dim=1)
    assert ((back - w).abs() / top).max() <= 0.25
    assert ((back - w).abs() / top).mean() < 0.05


def _release(model, path, drop: str | None = None):
    """The model's tensors as gpt-oss ships them: experts as MXFP4 blocks + scales ([E, out, in/32, 16])."""
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize_mxfp4(t.transpose(1, 2))
        else:
            tensors[name] = t.contiguous()
    if drop:
        tensors.pop(drop)
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_mxfp4_release_loads_like_transformers(tmp_path):
    """Logits of our load equal transformers' (which dequantises the same file, `Mxfp4Config(dequantize=True)`),
    run in fp32; the experts are far from the unquantised ones, so a wrong layout would show."""
    import transformers

    model = hf_model(GPT_OSS)
    path = _release(model, tmp_path / "mxfp4")
    ids = tokens(model.config.vocab_size)
    ours = trillora.load_model(path)
    ref = (
        transformers.AutoModelForCausalLM.from_pretrained(
            path,
            attn_implementation="eager",
            dtype=torch.float32,
            quantization_config=transformers.Mxfp4Config(dequantize=True),
        )
        .float()
        .eval()
    )
    with torch.no_grad():
        got, want, unquantised = ours(ids), ref(ids).logits, model(ids).logits
    assert (got - want).abs().max().item() <= 1e-4
    assert (got - unquantised).abs().max().item() > 1e-2
    from test_checkpoint import assert_expert_slice

    assert_expert_slice(trillora.load_model(path, experts=(1, 4)), ours, 1, 4)
    saved = trillora.save_model(ours, tmp_path / "dequantised")  # written back dequantised, without the quant config
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    again = transformers.AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        assert (again(ids).logits - want).abs().max().item() <= 1e-4


def test_blocks_without_scales_are_named(tmp_path):
    path = _release(hf_model(GPT_OSS), tmp_path / "bad", drop="model.layers.1.mlp.experts.down_proj_scales")
    with pytest.raises(CheckpointError, match=r"without their scales .*layers\.1\.mlp\.experts\.down_proj_blocks"):
        trillora.load_model(path)
