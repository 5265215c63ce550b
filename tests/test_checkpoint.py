"""Checkpoint folders: clear errors naming the file or tensor, atomic saves, tokenizers, tied embeddings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import trillora
from trillora.checkpoint import CheckpointError
from trillora.checkpoint import hf as hf_io
from trillora.checkpoint import weights as weights_io
from trillora.tiny import write_random_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def _copy(src, dst, change=None):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    if change:
        change(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_shard_is_named(tiny, tmp_path):
    bad = _copy(tiny, tmp_path / "bad")
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match="shard model-00002-of-00002.safetensors named in model.safetensors.index.json is missing"
    ):
        trillora.load_model(bad)


def test_wrong_shape_is_named(tiny, tmp_path):
    def shrink(t):
        t["model.norm.weight"] = torch.ones(3)

    with pytest.raises(
        CheckpointError, match=r"tensor 'model.norm.weight' has shape \(3,\), the model expects \(128,\)"
    ):
        trillora.load_model(_copy(tiny, tmp_path / "bad", shrink))


def test_missing_weights_are_named(tiny, tmp_path):
    def drop(t):
        del t["model.layers.2.self_attn.k_proj.weight"]

    with pytest.raises(CheckpointError, match="checkpoint lacks weights for model.layers.2.self_attn.k_proj.weight"):
        trillora.load_model(_copy(tiny, tmp_path / "bad", drop))


def test_missing_one_expert_is_named(tiny, tmp_path):
    """A per-expert checkpoint missing a single expert's up_proj is incomplete, not silently zero."""
    model = trillora.load_model(tiny)
    per_expert = hf_io.hf_state_dict(model, "per_expert")
    del per_expert["model.layers.0.mlp.experts.5.up_proj.weight"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tiny / "config.json").read_text())
    save_file(per_expert, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lacks weights for model.layers.0.mlp.experts.gate_up_proj"):
        trillora.load_model(bad)


def test_unexpected_tensor_is_named(tiny, tmp_path):
    def extra(t):
        t["model.layers.0.self_attn.mystery.weight"] = torch.ones(2)

    with pytest.raises(
        CheckpointError, match="tensor 'model.layers.0.self_attn.mystery.weight' has no place in a qwen3_moe model"
    ):
        trillora.load_model(_copy(tiny, tmp_path / "bad", extra))


def test_no_weights_no_tokenizer_are_named(tiny, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((tiny / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        trillora.load_model(empty)
    with pytest.raises(CheckpointError, match="no tokenizer files"):
        trillora.load_tokenizer(empty)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        trillora.load_model(tmp_path)


def test_tokenizer_loads_and_roundtrips(tiny):
    tok = trillora.load_tokenizer(tiny)
    ids = tok("12+34=46", add_special_tokens=False)["input_ids"]
    assert len(ids) == 8 and tok.decode(ids) == "12+34=46"


def test_save_is_atomic_on_failure(tiny, tmp_path, monkeypatch):
    model = trillora.load_model(tiny)
    dest = trillora.save_model(model, tmp_path / "out")
    before = (dest / "model.safetensors").read_bytes()
    calls = {"n": 0}
    real = hf_io.save_file

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real(*a, **k)

    monkeypatch.setattr(hf_io, "save_file", failing)
    with torch.no_grad():
        model.model.norm.weight.fill_(7.0)
    with pytest.raises(OSError, match="disk full"):
        trillora.save_model(model, dest, max_shard_bytes=100_000)
    assert (dest / "model.safetensors").read_bytes() == before  # the old checkpoint is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left behind


def test_tied_embeddings_roundtrip(tmp_path):
    from trillora.models import build_model, from_hf_config
    from trillora.tiny import TINY_QWEN3_MOE

    args = from_hf_config(dict(TINY_QWEN3_MOE, vocab_size=64, tie_word_embeddings=True))
    model = build_model(args, device="cpu")
    model.init_weights()
    out = trillora.save_model(model, tmp_path / "tied")
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))
    back = trillora.load_model(out)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))


def test_bf16_load_keeps_router_bias_fp32(tmp_path):
    from hf_models import DEEPSEEK_V3, hf_model, save_fused

    path = save_fused(hf_model(DEEPSEEK_V3), tmp_path / "ds")
    model = trillora.load_model(path, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert all(m.gate.e_score_correction_bias.dtype == torch.float32 for m in model.moe_layers())


@pytest.mark.slow
def test_generate_cli_runs_on_tiny(tiny):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "trillora", "generate", str(tiny), "--prompt", "1+1=", "--max-new-tokens", "4"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.startswith("1+1=")


def test_shipped_tiny_moe_loads_in_transformers_with_same_logits():
    import transformers

    from trillora.checkpoint import resolve_model_path

    path = resolve_model_path("tiny-moe")
    ours = trillora.load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    tok = trillora.load_tokenizer(path)
    ids = torch.tensor([[tok.bos_token_id] + tok("123+456=579", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() < 1e-4
    greedy = hf.generate(ids[:, :9], max_new_tokens=4, do_sample=False)
    assert greedy.shape[1] == 13  # transformers can decode from it too


def assert_expert_slice(part, whole, rank: int, size: int) -> None:
    """`part` holds exactly rows [rank·E/size, (rank+1)·E/size) of `whole`'s routed experts and
    every other tensor of it, and allocated nothing more."""
    from trillora.parallel.data_parallel import expert_parameter_names

    experts = expert_parameter_names(whole)
    local = whole.args.num_experts // size
    got, want = part.state_dict(), whole.state_dict()
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert torch.equal(got[k], t[rank * local : (rank + 1) * local] if k in experts else t), k
    assert sum(p.numel() for n, p in part.named_parameters() if n in experts) * size == sum(
        p.numel() for n, p in whole.named_parameters() if n in experts
    )


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_a_rank_loads_only_its_experts(tmp_path, layout, monkeypatch):
    """`load_model(experts=(rank, size))`, as a sharded Tinker service loads its base: the tensors
    one rank keeps under expert parallelism, from fused and from per-expert files; others are not read."""
    whole = trillora.load_model("tiny-moe-chat")
    path = trillora.save_model(whole, tmp_path / layout, expert_layout=layout)
    for rank in range(4):
        assert_expert_slice(trillora.load_model(path, experts=(rank, 4)), whole, rank, 4)
    with pytest.raises(CheckpointError, match="cannot keep experts slice 0 of 3"):
        trillora.load_model(path, experts=(0, 3))
    if layout == "per_expert":  # another rank's experts are not even read
        read = spy_on_reads(monkeypatch)
        assert_expert_slice(trillora.load_model(path, experts=(1, 2)), whole, 1, 2)
        experts_read = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
        assert experts_read == {4, 5, 6, 7}


def spy_on_reads(monkeypatch) -> list[str]:
    """The names of the tensors checkpoint loading reads from here on."""
    read, real = [], weights_io.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.f = real(*args, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(weights_io, "safe_open", Spy)
    return read


def test_a_pipeline_stage_loads_only_its_layers(tmp_path, monkeypatch):
    """`load_model(layers=...)`, as a pipeline-parallel Tinker service loads its base: a stage's
    layers (the embedding on the first, norm and head on the last) equal the whole model's, and
    nothing else is allocated or read."""
    from trillora.models.transformer import OtherStage

    whole = trillora.load_model("tiny-moe-chat")
    path = trillora.save_model(whole, tmp_path / "m")
    want = whole.state_dict()
    read = spy_on_reads(monkeypatch)
    for layers, top in (
        (range(0, 2), {"model.embed_tokens.weight"}),
        (range(1, 3), set()),
        (range(2, 4), {"model.norm.weight", "lm_head.weight"}),
    ):
        read.clear()
        stage = trillora.load_model(path, layers=layers, experts=(1, 2))
        got = stage.state_dict()
        kept = {k for k in want if k in top or any(k.startswith(f"model.layers.{i}.") for i in layers)}
        assert set(got) == kept
        assert isinstance(stage.model.layers[3 if layers.start == 0 else 0], OtherStage)
        for k in kept:
            w = want[k][4:8] if ".experts." in k else want[k]  # rank 1 of 2 keeps experts 4..7
            assert torch.equal(got[k], w), k
        assert {n for n in read} <= kept | {
            n for n in read if ".experts." in n and any(n.startswith(f"model.layers.{i}.") for i in layers)
        }
        assert {int(n.split(".")[2]) for n in read if n.startswith("model.layers.")} == set(layers)
    with pytest.raises(CheckpointError, match="cannot keep layers 3..4 of 4"):
        trillora.load_model(path, layers=range(3, 5))


def hub_cache(tmp_path, repo: str, files_from) -> tuple[str, dict]:
    """A Hugging Face Hub cache holding `repo` at one commit (refs/main names it), laid out as
    huggingface_hub lays it: models--org--name/{refs/main, snapshots/<commit>/...}; the
    environment of a process that reads it offline."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    cache = tmp_path / "hub"
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(files_from, repo_dir / "snapshots" / commit)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return commit, {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow  # CLI processes and a training run
def test_a_hub_id_is_resolved_offline_from_the_cache_with_its_revision_and_a_typo_is_named(tmp_path):
    from trillora.checkpoint import resolve_model_path

    commit, env = hub_cache(tmp_path, "trillora-test/tiny-moe", resolve_model_path("tiny-moe"))
    trillora_cli = [sys.executable, "-m", "trillora"]
    for name in ("trillora-test/tiny-moe", f"trillora-test/tiny-moe@{commit}"):
        out = subprocess.run(
            [*trillora_cli, "generate", name, "--prompt", "864+394=", "--max-new-tokens", "5"],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0 and out.stdout.strip() == "864+394=1258", out.stderr[-2000:]
    for name, message in [
        ("trillora-test/tiny-moe@main2", "not in the Hugging Face cache"),  # an unknown revision
        ("someone/missing", f"not in the Hugging Face cache ({tmp_path / 'hub'} with HF_HUB_OFFLINE=1)"),
        (
            "tiny-moee",
            "not a folder, not a Hugging Face Hub id (org/name) and not a shipped model: did you mean tiny-moe?",
        ),
    ]:
        out = subprocess.run(
            [*trillora_cli, "generate", name, "--prompt", "1+1="], capture_output=True, text=True, env=env, timeout=300
        )
        assert out.returncode == 2 and message in out.stderr, (name, out.stderr[-2000:])
    # a run names its Hub base in the exported adapter, as PEFT users pass one
    out = subprocess.run(
        [*trillora_cli, "train", "model.path=trillora-test/tiny-moe", f"out_dir={tmp_path}", "steps=1",
         "rollout.prompts_per_step=4", "rollout.group_size=2", "task.eval_problems=4", "task.eval_samples=1"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.loads((tmp_path / "default" / "adapter" / "fused" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "trillora-test/tiny-moe"
