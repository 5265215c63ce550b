"""vLLM as the rollout engine, for real: in-process (`VLLMEngine`) and as OpenAI servers.

Every check compares vLLM's logprobs with the trainer's on the same tokens, before and after
a sync, so a sync that did not reach the engine fails. `make test` installs the `vllm` extra
and sets TRILLORA_REQUIRE_VLLM=1, which turns a missing vLLM into a failure, not a skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
import torch

if os.environ.get("TRILLORA_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from engine_helpers import free_port, trainer_logprobs, wait_for_health

from trillora import lora
from trillora.checkpoint import load_model, resolve_model_path
from trillora.rollout import OpenAIEngine, SamplingParams
from trillora.rollout.vllm import VLLMEngine, choose_sync
from trillora.rollout.vllm_sync import merged_tensors
from trillora.tiny import write_random_checkpoint

pytestmark = pytest.mark.slow  # vLLM servers

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [30, 31]]
SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, stop_token_ids=(2,))
TOL = 1e-4  # fp32 vLLM vs fp32 trainer, same weights (observed 1e-6 .. 4e-6)


def randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in lora.lora_parameters(model):
            p.normal_(0, 0.1, generator=g)


def agree(engine, model, params=SAMPLED, prompts=PROMPTS) -> list:
    out = [c for g in engine.generate(prompts, 3, params) for c in g]
    ours, theirs = trainer_logprobs(model, out)
    assert (ours - theirs).abs().max() < TOL
    return out


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("dense") / "tiny-dense", dense=True)


def test_merged_sync_reaches_vllm_on_moe(tmp_path):
    """MoE on CPU: vLLM cannot apply LoRA, so every adapted tensor (attention, routed experts,
    router) is merged and written into the running engine."""
    model = load_model(resolve_model_path("tiny-moe"))
    lora.apply_lora(model, lora.LoraConfig(rank=4, targets=("attention", "experts", "router")))
    assert choose_sync(model) == "merged"
    engine = VLLMEngine(resolve_model_path("tiny-moe"), model, max_model_len=64)
    try:
        before = agree(engine, model)  # B = 0: the base
        assert [c.finish_reason for c in before].count("stop") >= 1  # the stop token ends and is kept
        assert all(c.token_ids[-1] == 2 for c in before if c.finish_reason == "stop")
        for seed in (0, 1):
            randomize(model, seed)
            cost = engine.sync(model)
            after = agree(engine, model)
            base, theirs = trainer_logprobs(load_model(resolve_model_path("tiny-moe")), after)
            assert (base - theirs).abs().max() > 1e-2  # vLLM runs the adapter, not the base
        # what was sent: the tensors the adapter changes and their fused siblings, nothing else
        sent = merged_tensors(model)
        assert cost["sync_bytes"] == sum(t.numel() * t.element_size() for t in sent.values())
        assert not any("embed" in k or "norm" in k or "lm_head" in k for k in sent)
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in sent and "model.layers.3.mlp.gate.weight" in sent
    finally:
        engine.close()


def test_merged_sync_reaches_vllm_on_gpt_oss(tmp_path):
    """gpt-oss in vLLM (sinks, sliding windows, biased router and experts): the base agrees with us,
    and the merged attention, router and expert tensors land in vLLM's own layout (qkv fused, the
    router `mlp.router`, gate/up interleaved rows for its clamped SwiGLU). vLLM's CPU kernels need
    64-wide heads, and clamp at the released limit (7) whatever the config says."""
    from hf_models import GPT_OSS, hf_model

    from trillora.tiny import build_tokenizer

    tok = build_tokenizer()
    hf = hf_model(dict(GPT_OSS, vocab_size=len(tok), head_dim=64, num_attention_heads=4, swiglu_limit=7.0))
    hf.save_pretrained(tmp_path / "gpt-oss")
    tok.save_pretrained(tmp_path / "gpt-oss")
    model = load_model(tmp_path / "gpt-oss")
    lora.apply_lora(model, lora.LoraConfig(rank=4, targets=("attention", "experts", "router")))
    engine = VLLMEngine(tmp_path / "gpt-oss", model, max_model_len=64)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11]]  # 24 tokens: past the 16-token window
    try:
        agree(engine, model, prompts=prompts)
        randomize(model, 0)
        engine.sync(model)
        after = agree(engine, model, prompts=prompts)
        base, theirs = trainer_logprobs(load_model(tmp_path / "gpt-oss"), after)
        assert (base - theirs).abs().max() > 1e-2  # vLLM runs the adapter, not the base
        assert "model.layers.1.mlp.router.weight" in merged_tensors(model)
    finally:
        engine.close()


def test_adapter_sync_on_dense(dense_path, tmp_path):
    """A dense model: vLLM applies the adapter itself (LoRARequest), revision after revision."""
    model = load_model(dense_path)
    lora.apply_lora(model, lora.LoraConfig(rank=4, targets=("attention", "mlp")))
    assert choose_sync(model) == "adapter"
    engine = VLLMEngine(dense_path, model, sync_dir=tmp_path / "sync", max_model_len=64)
    try:
        agree(engine, model)
        for seed in (0, 1):
            randomize(model, seed)
            cost = engine.sync(model)
            after = agree(engine, model)
            base, theirs = trainer_logprobs(load_model(dense_path), after)
            assert (base - theirs).abs().max() > 1e-2
        assert cost["sync_bytes"] < 200_000  # the adapter, not the 1.3 MB of touched base weights
        assert engine.llm.llm_engine.list_loras() == {2}  # revision 1 was removed from the engine
        assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["rev-2"]
    finally:
        engine.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal; on GPU vLLM returns routing")
def test_routing_return_refused_clearly_on_cpu():
    model = load_model(resolve_model_path("tiny-moe"))
    lora.apply_lora(model, lora.LoraConfig(rank=2, targets=("experts",)))
    with pytest.raises(RuntimeError, match="V2 model runner"):
        VLLMEngine(resolve_model_path("tiny-moe"), model, max_model_len=64, return_routing=True)


def rl_config(tmp_path, *extra):
    from trillora.config import load_config

    return load_config(
        None,
        [
            f"out_dir={tmp_path}",
            "name=run",
            "steps=2",
            "eval_every=2",
            "rollout.prompts_per_step=8",
            "rollout.group_size=4",
            "task.eval_problems=8",
            "task.eval_samples=1",
            'task.retention=""',
            "optim.lr=0.01",
            *extra,
        ],
    )


def moved(before, after, model) -> None:
    """The engine's logprobs of a fixed prompt moved with the update and equal the trainer's."""
    ours, theirs = trainer_logprobs(model, after)
    assert (ours - theirs).abs().max() < TOL
    same = [(b, a) for b, a in zip(before, after, strict=True) if b.token_ids == a.token_ids]
    changed = (
        len(same) < len(before)
        or max(abs(x - y) for b, a in same for x, y in zip(b.logprobs, a.logprobs, strict=True)) > 1e-3
    )
    assert changed


def test_rl_steps_with_vllm_in_process(tmp_path):
    from trillora.trainer import Trainer

    trainer = Trainer(
        rl_config(tmp_path, 'rollout.engine="vllm"')
    )  # as the README writes it: the model's 512 positions
    assert trainer.cfg.rollout.max_model_len == 512
    try:
        assert isinstance(trainer.engine, VLLMEngine) and trainer.engine.sync_mode == "merged"
        fixed = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11, stop_token_ids=(2,))
        before = [c for g in trainer.engine.generate(PROMPTS, 2, fixed) for c in g]
        summary = trainer.run(close_engine=False)
        after = [c for g in trainer.engine.generate(PROMPTS, 2, fixed) for c in g]
        moved(before, after, trainer.model)
    finally:
        trainer.engine.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][1:]
    assert summary["steps"] == 2 and all(r["sync_bytes"] > 0 for r in rows)
    assert all(r["mismatch_kl_k3"] < 1e-6 for r in rows)  # fp32 vLLM vs fp32 trainer


def start_vllm_server(path, *extra, env=None):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(path),
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "128",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--logprobs-mode",
        "processed_logprobs",
        "--seed",
        "0",
        *extra,
    ]
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    failure = wait_for_health(proc, url, 300)
    if failure:
        raise RuntimeError(f"vLLM server did not come up: {failure}")
    return proc, url


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_rl_steps_against_vllm_server_merged(tmp_path):
    """MoE on a vLLM OpenAI server: merged tensors through /collective_rpc into our worker extension."""
    from trillora.trainer import Trainer

    proc, url = start_vllm_server(
        resolve_model_path("tiny-moe"),
        "--worker-extension-cls",
        "trillora.rollout.vllm_sync.WeightSyncExtension",
        env={"VLLM_SERVER_DEV_MODE": "1", "TRILLORA_SYNC_DIR": str(tmp_path / "run" / "sync")},
    )
    try:
        probe = OpenAIEngine(url, model="tiny")
        # an attacker on the port: /collective_rpc is not behind vLLM's --api-key; the extension refuses
        refused = probe._post(url, "/collective_rpc", {"method": "trillora_load_merged", "args": ["/etc/passwd"]})
        assert all(r.startswith("refused:") for r in refused["results"]), refused
        fixed = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11, stop_token_ids=(2,))
        before = [c for g in probe.generate(PROMPTS, 2, fixed) for c in g]
        trainer = Trainer(
            rl_config(
                tmp_path,
                'rollout.engine="openai"',
                f'rollout.urls=["{url}"]',
                'rollout.server_model="tiny"',
                'rollout.sync="merged"',
            )
        )
        summary = trainer.run()
        after = [c for g in probe.generate(PROMPTS, 2, fixed) for c in g]
        moved(before, after, trainer.model)
        assert summary["steps"] == 2 and not list((tmp_path / "run" / "sync").glob("*.safetensors"))  # files cleaned up
        probe.close()
    finally:
        stop(proc)


def test_rl_steps_against_vllm_server_adapter(dense_path, tmp_path):
    """A dense model on a vLLM OpenAI server: adapter revisions through the dynamic LoRA endpoints."""
    from trillora.trainer import Trainer

    proc, url = start_vllm_server(
        dense_path, "--enable-lora", "--max-lora-rank", "8", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    )
    try:
        model = load_model(dense_path)
        lora.apply_lora(model, lora.LoraConfig(rank=4, targets=("attention", "mlp")))
        engine = OpenAIEngine(url, model="tiny", sync_dir=tmp_path / "sync")
        agree(engine, model)
        randomize(model, 0)
        engine.sync(model)
        after = agree(engine, model)
        base, theirs = trainer_logprobs(load_model(dense_path), after)
        assert (base - theirs).abs().max() > 1e-2
        engine.sync(model)
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            names = sorted(m["id"] for m in json.loads(r.read())["data"])
        assert names == ["tiny", f"tiny-{engine.tag}-r2"]  # r1 unloaded
        engine.close()
        # and the trainer drives it (a random dense model earns little reward; the run checks the wiring)
        trainer = Trainer(
            rl_config(
                tmp_path,
                f'model.path="{dense_path}"',
                'lora.targets=["attention", "mlp"]',
                "lora.rank=4",
                'rollout.engine="openai"',
                f'rollout.urls=["{url}"]',
                'rollout.server_model="tiny"',
                f'rollout.sync_dir="{tmp_path / "rl"}"',
            )
        )
        summary = trainer.run()
        assert summary["steps"] == 2 and sorted(p.name for p in (tmp_path / "rl").iterdir()) == [trainer.engine.model]
    finally:
        stop(proc)
