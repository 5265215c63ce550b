"""What merged sync sends to vLLM, checked without vLLM: names, siblings, values, grouping."""

from __future__ import annotations

import pytest
import torch

from trillora import lora
from trillora.checkpoint import hf_state_dict, load_model, resolve_model_path
from trillora.rollout.vllm import choose_sync
from trillora.rollout.vllm_sync import _group, merged_tensors

pytestmark = pytest.mark.slow  # vLLM engines


def adapted(**cfg):
    model = load_model(resolve_model_path("tiny-moe"))
    lora.apply_lora(model, lora.LoraConfig(rank=2, **cfg))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in lora.lora_parameters(model):
            p.normal_(0, 0.1, generator=g)
    return model


def test_only_q_proj_sends_its_fused_siblings_unchanged():
    model = adapted(targets=(), patterns=("model.layers.1.self_attn.q_proj",))
    sent = merged_tensors(model)
    prefix = "model.layers.1.self_attn."
    assert sorted(sent) == [prefix + "k_proj.weight", prefix + "q_proj.weight", prefix + "v_proj.weight"]
    base = hf_state_dict(load_model(resolve_model_path("tiny-moe")), "per_expert")
    assert torch.equal(sent[prefix + "k_proj.weight"], base[prefix + "k_proj.weight"])  # sibling: base, as is
    q = model.get_submodule(prefix + "q_proj")
    expected = base[prefix + "q_proj.weight"] + q.lora_scaling * q.lora_B @ q.lora_A
    assert torch.allclose(sent[prefix + "q_proj.weight"], expected, atol=1e-6)
    groups = _group(sent)
    assert list(groups) == [prefix + "qkv_proj"] and sorted(groups[prefix + "qkv_proj"]["parts"]) == [0, 1, 2]


def test_experts_go_per_expert_and_merged_equals_the_adapted_forward():
    model = adapted(targets=("experts",))
    sent = merged_tensors(model)
    assert len(sent) == 4 * 8 * 3  # 4 layers x 8 experts x gate/up/down
    groups = _group(sent)
    assert sorted(groups) == [f"model.layers.{i}.mlp.experts" for i in range(4)]
    assert all(len(g["gate"]) == len(g["up"]) == len(g["down"]) == 8 for g in groups.values())
    # writing what was sent into a fresh base reproduces the adapted model's logits
    plain = load_model(resolve_model_path("tiny-moe"))
    with torch.no_grad():
        for name, m in plain.named_modules():
            if name.endswith(".mlp.experts"):
                for e in range(8):
                    m.gate_up_proj[e] = torch.cat(
                        [sent[f"{name}.{e}.gate_proj.weight"], sent[f"{name}.{e}.up_proj.weight"]]
                    )
                    m.down_proj[e] = sent[f"{name}.{e}.down_proj.weight"]
        ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
        assert torch.allclose(plain(ids), model(ids), atol=1e-5)


def test_auto_sync_choice():
    assert choose_sync(adapted(targets=("experts",))) == ("merged" if not torch.cuda.is_available() else "adapter")
    assert choose_sync(adapted(targets=("router",))) == "merged"  # vLLM has no router LoRA
    assert choose_sync(adapted(targets=("experts",)), "adapter") == "adapter"


def test_adapter_sync_writes_the_layout_vllm_reads_for_the_family():
    """vLLM keeps gpt-oss's experts 3-D (`is_3d_moe_weight`) and reads PEFT's fused form for it;
    the other families' experts it reads per expert."""
    from hf_models import GPT_OSS

    from trillora.lora.export import vllm_layout
    from trillora.models import build_model, from_hf_config

    assert vllm_layout(adapted(targets=("experts",))) == "per_expert"
    assert vllm_layout(build_model(from_hf_config(GPT_OSS), device="meta")) == "fused"


def test_the_worker_extension_loads_only_safetensors_inside_the_sync_dir(tmp_path, monkeypatch):
    """vLLM's /collective_rpc is outside what its --api-key guards: the extension itself refuses
    any file but a .safetensors inside TRILLORA_SYNC_DIR, as a result string (no worker raise)."""
    from trillora.rollout.vllm_sync import SYNC_DIR_ENV, WeightSyncExtension

    sync = tmp_path / "sync"
    sync.mkdir()
    inside = sync / "merged-r1.safetensors"
    ext = WeightSyncExtension()
    monkeypatch.delenv(SYNC_DIR_ENV, raising=False)
    assert ext.trillora_load_merged(str(inside)).startswith(f"refused: set {SYNC_DIR_ENV}")
    monkeypatch.setenv(SYNC_DIR_ENV, str(sync))
    for attempt in [
        "/etc/passwd",
        str(tmp_path / "elsewhere.safetensors"),
        str(sync / ".." / "x.safetensors"),
        str(sync / "merged-r1.bin"),
        str(sync),
    ]:
        assert ext.trillora_load_merged(attempt).startswith("refused:"), attempt
    (sync / "evil.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    assert ext.trillora_load_merged(str(sync / "evil.safetensors")).startswith("refused:")  # resolved, then checked
    from trillora.rollout.vllm_sync import allowed_sync_file

    assert allowed_sync_file(str(inside)) == inside.resolve()
