"""FLOP accounting of an RL run (`trillora.trainer.flops`): the per-token constants of tiny-moe
counted by hand, each pass's formula on small lengths, and the trainer's metrics.jsonl columns."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import SMALL_RUN

from trillora import lora
from trillora.checkpoint import load_model
from trillora.config import load_config
from trillora.models import build_model
from trillora.trainer import Trainer
from trillora.trainer.flops import ModelFlops, attention_width, pairs, rollout_flops

# tiny-moe: hidden 128, 4 layers, 4 heads × 32 (2 kv heads), 8 experts (top 2) of width 64, vocab 100
ATTENTION = 128 * 128 + 64 * 128 + 64 * 128 + 128 * 128  # q, k, v, o = 49152
ROUTER = 8 * 128
EXPERTS = 2 * (128 * 128 + 128 * 64)  # two routed experts' gate+up [128, 128] and down [128, 64] = 49152
HEAD = 100 * 128
FROZEN = 2 * (4 * (ATTENTION + ROUTER + EXPERTS) + HEAD)  # 820224
# rank 4: A [4, in] and B [out, 4] on q, k, v, o; per expert gate, up (128 → 64) and down (64 → 128)
LORA_ATTENTION = (4 * 128 + 128 * 4) + 2 * (4 * 128 + 64 * 4) + (4 * 128 + 128 * 4)  # 3584
LORA_EXPERTS = 2 * (2 * (4 * 128 + 64 * 4) + (4 * 64 + 128 * 4))  # two experts × 2304 = 4608
TRAINED = 2 * 4 * (LORA_ATTENTION + LORA_EXPERTS)  # 65536
PAIR = 2 * 4 * 4 * (32 + 32)  # q·k and the weighted v, per head and layer: 2048


@pytest.fixture(scope="module")
def tiny():
    model = load_model("tiny-moe")
    lora.apply_lora(model, lora.LoraConfig(rank=4))
    return ModelFlops.of(model)


def test_tiny_moe_constants_match_a_hand_count(tiny):
    assert (FROZEN, TRAINED) == (820224, 65536)
    assert tiny == ModelFlops(frozen=FROZEN, trained=TRAINED, head=2 * HEAD, adapter=TRAINED, attention=PAIR)


def test_each_pass_by_hand(tiny):
    w = FROZEN + TRAINED  # 885760
    assert pairs(1) == 1 and pairs(5) == 15
    # a 10-token prompt writing 3 tokens feeds 12 positions; the head runs at the 3 it samples from
    assert tiny.sample(10, 3) == (w - 2 * HEAD) * 12 + 2 * HEAD * 3 + PAIR * 78 == 10558464
    assert tiny.forward(5) == w * 5 + PAIR * 15 == 4459520
    assert tiny.forward(5, adapters=False) == FROZEN * 5 + PAIR * 15  # the reference pass: no adapters
    # backward: the input gradient (one forward's worth) and weight gradients for the adapters only
    assert tiny.backward(5) == (w + TRAINED) * 5 + 2 * PAIR * 15 == 4817920
    # two epochs of forward + backward, the proximal logprob pass, the reference pass
    assert tiny.train_step([5], epochs=2, proximal=True, reference=True) == 27146240
    assert tiny.train_step([5, 5], epochs=1, proximal=False, reference=False) == 2 * (4459520 + 4817920)


def test_full_parameter_training_counts_every_weight_gradient_and_a_tied_head_once():
    model = load_model("tiny-moe")  # nothing frozen: full-parameter training
    full = ModelFlops.of(model)
    assert (full.frozen, full.trained, full.adapter) == (0, FROZEN, 0)
    assert full.backward(5) == 2 * FROZEN * 5 + 2 * PAIR * 15
    tied = build_model(dataclasses.replace(model.args, tie_word_embeddings=True), device="meta")
    for p in tied.parameters():
        p.requires_grad_(False)
    assert ModelFlops.of(tied).frozen == FROZEN  # the embedding is a lookup; its tied head is the matmul
    mla = dataclasses.replace(model.args, kv_lora_rank=16, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=20)
    assert attention_width(mla) == 52 and attention_width(model.args) == 64


def test_sliding_window_layers_count_only_their_window():
    """gpt-oss: each query of a window-4 layer sees itself and 3 before: 1+2+3+4 then 4 per position."""
    from hf_models import GPT_OSS

    from trillora.models import from_hf_config
    from trillora.plan.flops import mean_keys

    assert pairs(10, 4) == 1 + 2 + 3 + 4 * 7 == 34 and pairs(3, 4) == pairs(3) == 6
    assert mean_keys(10, 4) == 3.4 and mean_keys(10, 0) == 5.0  # the planner's per-query mean
    args = from_hf_config(dict(GPT_OSS, sliding_window=4))
    assert args.layer_windows == (4, 0, 4, 0)  # sliding on even layers, as transformers defaults
    model = ModelFlops.of(build_model(args, device="meta"))
    per_layer = model.attention / 4
    assert model.forward(10) - model.weights * 10 == per_layer * (34 + 55 + 34 + 55)
    assert model.backward(10) - (model.weights + model.trained) * 10 == 2 * per_layer * (34 + 55 + 34 + 55)


def test_a_run_logs_rollout_train_and_cumulative_flops(tmp_path):
    """metrics.jsonl per step: every engine call (all dynamic-sampling rounds, dropped groups too)
    and the update's passes (2 epochs × 2 minibatches: a proximal pass first)."""
    cfg = load_config(
        None,
        [
            f"out_dir={tmp_path}",
            *SMALL_RUN,
            "steps=2",
            "eval_every=2",
            "name=f",
            "rollout.prompts_per_step=4",
            "algorithm.epochs=2",
            "algorithm.minibatches=2",
            "algorithm.dynamic_sampling=true",
            "algorithm.max_sampling_rounds=3",
        ],
    )
    trainer = Trainer(cfg)
    seen = []
    sample = trainer.sampler.sample

    def recorded(step):
        batch = sample(step)
        seen.append(batch)
        return batch

    trainer.sampler.sample = recorded
    trainer.run()
    rows = [json.loads(x) for x in (tmp_path / "f" / "metrics.jsonl").read_text().splitlines()][1:]
    total = 0.0
    for row, batch in zip(rows, seen, strict=True):
        kept = rollout_flops(trainer.flops, batch.groups)
        assert row["flops_rollout"] >= kept > 0
        if batch.stats.get("groups_dropped", 0) > 0:
            assert row["flops_rollout"] > kept  # the dropped groups were sampled too
        lengths = [
            len(x.observation) + len(x.action) for g in batch.groups for t in g.trajectories for x in t.transitions
        ]  # single turn: a row is its prompt and completion
        assert sorted(batch.row_lengths) == sorted(lengths)
        assert row["flops_train"] == trainer.flops.train_step(lengths, 2, True, False)
        total += row["flops_rollout"] + row["flops_train"]
        assert row["flops_total"] == pytest.approx(total, rel=1e-12)
    summary = json.loads((tmp_path / "f" / "summary.json").read_text())
    assert summary["flops_total"] == rows[-1]["flops_total"]


def test_a_flops_budget_ends_the_run_at_the_step_that_spends_it(tmp_path):
    """`flops_budget`: the run stops after the step whose cumulative FLOPs reach it, evaluates that
    step and finishes as usual (summary, export), whatever `steps` says."""
    common = [f"out_dir={tmp_path}", *SMALL_RUN, "eval_every=100"]
    Trainer(load_config(None, [*common, "steps=3", "name=probe"])).run()
    probe = [json.loads(x) for x in (tmp_path / "probe" / "metrics.jsonl").read_text().splitlines()][1:]
    budget = (probe[0]["flops_total"] + probe[1]["flops_total"]) / 2  # spent during the second step
    summary = Trainer(load_config(None, [*common, "steps=50", "name=b", f"flops_budget={budget}"])).run()
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval_accuracy" in rows[-1] and "eval_accuracy" not in rows[1]
    assert rows[1]["flops_total"] < budget <= rows[2]["flops_total"] == summary["flops_total"]
    assert summary["steps_done"] == 2 and (tmp_path / "b" / "adapter" / "fused").is_dir()
    with pytest.raises(Exception, match="flops_budget"):
        load_config(None, ["flops_budget=-1"])


@pytest.mark.slow
def test_build_family_pretrains_each_width_for_its_token_budget(tmp_path):
    """`python -m trillora.tiny build-family`: the shipped recipe at two widths, each trained for
    tokens-per-param × its parameters (to within one step's rows), loadable, with its report."""
    import subprocess
    import sys

    from trillora.tiny import TINY_QWEN3_MOE, tiny_config

    assert tiny_config(128) == TINY_QWEN3_MOE  # the shipped model is the family's width 128
    with pytest.raises(ValueError, match="width=100"):
        tiny_config(100)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "trillora.tiny",
            "build-family",
            str(tmp_path),
            "--widths",
            "64",
            "128",
            "--tokens-per-param",
            "0.02",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    for width, params in ((64, 261440), (128, 1014144)):
        report = json.loads((tmp_path / f"w{width}" / "pretrain_report.json").read_text())
        model = load_model(tmp_path / f"w{width}")
        assert report["params"] == params == sum(p.numel() for p in model.parameters())
        assert model.args.hidden_size == width and model.args.num_heads == width // 32
        per_step = report["tokens"] / report["steps"]
        assert abs(report["tokens"] - 0.02 * params) < per_step, report

    # the study on that family at a toy budget: a LoRA and a full arm, stopped at the same FLOPs
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "compute_matched.py"
    out = tmp_path / "cm.json"
    run = subprocess.run(
        [
            sys.executable,
            str(bench),
            "--family",
            str(tmp_path),
            "--arms",
            "w128:lora8",
            "w64:full",
            "--seeds",
            "0",
            "--flops",
            "3e9",
            "--evals",
            "3",
            "--eval-problems",
            "8",
            "--out",
            str(out),
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            'task.retention=""',
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = {r["arm"]: r for r in report["runs"]}
    assert set(runs) == {"w128:lora8", "w64:full"} and out.with_suffix(".png").is_file()
    for r in runs.values():
        assert r["flops"] >= 3e9 > r["curve"][-2]["flops"]  # stopped at the step that spent the budget
        assert r["curve"][0]["flops"] == 0.0 and r["curve"][-1]["flops"] == r["flops"]
        assert 4 <= len(r["curve"]) <= 6  # before, about 3 at equal FLOP steps, and the last
    assert runs["w64:full"]["trained_params"] == 261440 and runs["w128:lora8"]["trained_params"] < 261440
    assert runs["w64:full"]["steps"] > runs["w128:lora8"]["steps"]  # the smaller model buys more steps
    assert report["task"] == "arithmetic" and report["family"]["w64"]["params"] == 261440
    out.with_suffix(".png").unlink()  # --plot-only redraws from the JSON, no training
    again = subprocess.run(
        [sys.executable, str(bench), "--plot-only", "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0 and out.with_suffix(".png").is_file(), again.stderr[-2000:]
