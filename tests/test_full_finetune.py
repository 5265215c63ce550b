"""Full-parameter RL (`finetune = "full"`): the other arm of a compute-matched comparison. Every
weight trains, the engine samples with all of them after a sync, the run exports a model that
loads, resumes bit for bit, and what cannot work is refused before anything starts."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SMALL_RUN
from safetensors.torch import load_file

from trillora.checkpoint import load_model
from trillora.config import load_config
from trillora.errors import ConfigError
from trillora.trainer import Trainer


def full_run(tmp_path, name: str, *extra: str) -> Trainer:
    return Trainer(
        load_config(None, [f"out_dir={tmp_path}", *SMALL_RUN, "finetune=full", f"name={name}", "optim.lr=1e-3", *extra])
    )


def test_every_weight_trains_and_the_engine_and_export_follow(tmp_path):
    base = load_model("tiny-moe")
    trainer = full_run(tmp_path, "full")
    assert len(trainer.policy.opt.param_groups[0]["params"]) == len(list(base.parameters()))  # nothing frozen
    summary = trainer.run(close_engine=False)
    assert summary["finetune"] == "full"
    after = dict(trainer.model.named_parameters())
    moved = {n for n, p in base.named_parameters() if not torch.equal(p, after[n])}
    assert {
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.3.self_attn.q_proj.weight",
        "model.norm.weight",
    } <= moved
    engine = trainer.engine.model.state_dict()  # the engine samples with bf16-rounded copies of every weight
    for n, p in after.items():
        assert torch.equal(engine[n].float(), p.detach().to(torch.bfloat16).float()), n
    exported = load_model(tmp_path / "full" / "model")
    assert all(torch.equal(p, after[n]) for n, p in exported.named_parameters())
    assert not (tmp_path / "full" / "adapter").exists()
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()][1:]
    assert trainer.flops.trained == trainer.flops.weights and all(r["flops_train"] > 0 for r in rows)


def test_a_resumed_full_run_ends_bit_identical(tmp_path):
    full_run(tmp_path, "whole", "steps=3", "eval_every=3").run()
    full_run(tmp_path, "split", "steps=2", "eval_every=3").run()
    full_run(tmp_path, "split", "steps=3", "eval_every=3", "resume=true").run()
    one, two = (load_file(str(tmp_path / r / "model" / "model.safetensors")) for r in ("whole", "split"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    last = [json.loads((tmp_path / r / "metrics.jsonl").read_text().splitlines()[-1]) for r in ("whole", "split")]
    assert last[0]["loss"] == last[1]["loss"] and last[0]["flops_total"] == last[1]["flops_total"]


@pytest.mark.parametrize(
    "override, named", [("rollout.engine=openai", "rollout.engine"), ("algorithm.kl_coef=0.1", "algorithm.kl_coef")]
)
def test_what_full_training_cannot_do_is_refused_by_name(tmp_path, override, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, [f"out_dir={tmp_path}", "finetune=full", override, 'rollout.urls=["http://x"]'])
    with pytest.raises(ConfigError, match="finetune"):
        load_config(None, ["finetune=partial"])
