"""Router replay: a bf16-weight rollout engine and the fp32 trainer route some tokens differently;
replaying the recorded routing makes the trainer use exactly the rollout's experts."""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import build_batch
from hf_models import CONFIGS

from trillora import lora
from trillora.config import ConfigError, load_config
from trillora.models import build_model, from_hf_config
from trillora.policy.logprobs import token_logprobs
from trillora.rollout import LocalEngine, SamplingParams
from trillora.rollout.routing import record_routing
from trillora.trainer import Trainer
from trillora.trainer.router_replay import compare_routing


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def rollout(request):
    model = build_model(from_hf_config(CONFIGS[request.param]), device="cpu")
    model.init_weights(std=0.05, generator=torch.Generator().manual_seed(0))
    lora.apply_lora(model, lora.LoraConfig(rank=4, targets=("experts",)))
    engine = LocalEngine(model, precision="bf16_weights")  # the sampler's weights are bf16-rounded
    prompts = torch.randint(3, 100, (16, 12), generator=torch.Generator().manual_seed(1)).tolist()
    groups = engine.generate(prompts, 2, SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, return_routing=True))
    flat = [c for g in groups for c in g]
    batch = build_batch(
        [c.prompt_ids for c in flat],
        [c.token_ids for c in flat],
        [c.logprobs for c in flat],
        routes=[c.routed_experts for c in flat],
    )
    return model, batch


def test_trainer_routes_differently_without_replay_and_exactly_as_recorded_with_it(rollout):
    model, batch = rollout
    valid = batch.routes_valid
    with (
        torch.no_grad(),
        compare_routing(model, batch.routes, valid, replay=False) as refs,
        record_routing(model) as own,
    ):
        free = token_logprobs(model, batch.input_ids)[0]
    differ = sum(r.differ for r in refs)
    assert differ > 0 and all(r.tokens == int(valid.sum()) for r in refs)
    with compare_routing(model, batch.routes, valid, replay=True) as refs, record_routing(model) as used:
        replayed = token_logprobs(model, batch.input_ids)[0]
        (replayed * batch.completion_mask).sum().backward()  # gradients flow through the replayed gates
    for layer, (calls, _own_calls) in enumerate(zip(used.values(), own.values(), strict=True)):
        recorded = batch.routes[:, :, layer].long().sort(-1).values
        assert torch.equal(calls[0].sort(-1).values[valid], recorded[valid])  # exactly the rollout's experts
    assert not torch.equal(free, replayed)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for _, p in lora.lora_parameters(model))


def test_replay_needs_matching_shapes(rollout):
    model, batch = rollout
    with (
        pytest.raises(ValueError, match="does not match this call's"),
        torch.no_grad(),
        compare_routing(model, batch.routes[:, :-1], batch.routes_valid[:, :-1], replay=True),
    ):
        token_logprobs(model, batch.input_ids)


@pytest.mark.parametrize("mode", ["off", "all", "old"])
def test_trainer_logs_routing_mismatch_per_layer(tmp_path, small_config, mode):
    cfg = small_config(
        "algorithm.minibatches=2",
        f"algorithm.router_replay={json.dumps(mode)}",
        "algorithm.routing_metrics=true",
        "parallel.activation_checkpoint_every=1",
        name=mode,
    )
    Trainer(cfg).run()
    rows = [json.loads(x) for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()[1:]]
    for r in rows:
        layers = [r[f"routing_mismatch_l{i}"] for i in range(4)]
        assert all(0.0 <= x <= 1.0 for x in layers) and r["routing_mismatch"] == pytest.approx(sum(layers) / 4)


def test_replay_under_activation_checkpointing_trains_the_same_adapter(tmp_path, small_config):
    """Checkpointing recomputes each block's forward during backward: the recomputation must route
    to the rollout's experts too. Replay with and without checkpointing: the same losses and the
    same adapter, and routes that differ from the free router's (so replay did something)."""
    from safetensors.torch import load_file

    runs = {}
    for ckpt in (0, 1):
        name = f"replay-ckpt{ckpt}"
        Trainer(
            small_config(
                "algorithm.minibatches=2",
                'algorithm.router_replay="all"',
                "algorithm.routing_metrics=true",
                f"parallel.activation_checkpoint_every={ckpt}",
                name=name,
            )
        ).run()
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()[1:]]
        runs[ckpt] = rows, load_file(str(tmp_path / name / "adapter" / "fused" / "adapter_model.safetensors"))
    (plain, a), (checkpointed, b) = runs[0], runs[1]
    assert [r["loss"] for r in plain] == pytest.approx([r["loss"] for r in checkpointed], rel=1e-6, abs=1e-7)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)
    assert any(r["routing_mismatch"] > 0 for r in checkpointed)  # the free router would have chosen otherwise


def test_router_replay_refuses_an_engine_without_routing(tmp_path):
    with pytest.raises(ConfigError, match="rollout.engine='openai' does not return them"):
        Trainer(
            load_config(
                None,
                [
                    f"out_dir={tmp_path}",
                    'algorithm.router_replay="all"',
                    'rollout.engine="openai"',
                    'rollout.urls=["http://127.0.0.1:9"]',
                ],
            )
        )
