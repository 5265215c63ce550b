"""The trainer end to end on the shipped tiny MoE: files a run writes, reward rising,
the mismatch metrics with and without correction, adapters that reload."""

from __future__ import annotations

import json

import pytest
import torch

from trillora import lora
from trillora.checkpoint import load_model, resolve_model_path
from trillora.config import load_config
from trillora.trainer import Trainer

pytestmark = pytest.mark.slow  # whole training runs

SMALL = ["rollout.prompts_per_step=8", "rollout.group_size=4", "task.eval_problems=64", "task.eval_samples=1"]


def run(tmp_path, *overrides):
    cfg = load_config(None, [f"out_dir={tmp_path}", *SMALL, *overrides])
    trainer = Trainer(cfg)
    return trainer, trainer.run(), cfg.run_dir


def test_run_writes_everything_and_reward_rises(tmp_path):
    trainer, summary, run_dir = run(
        tmp_path,
        "name=rises",
        "steps=20",
        "eval_every=20",
        "task.eval_problems=256",
        "rollout.prompts_per_step=32",
        "rollout.group_size=8",
    )
    for name in (
        "config.toml",
        "metrics.jsonl",
        "summary.json",
        "reward.png",
        "accuracy.png",
        "mismatch_kl.png",
        "is_weights.png",
        "adapter/per_expert/adapter_config.json",
        "adapter/fused/adapter_model.safetensors",
    ):
        assert (run_dir / name).exists(), name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {
        "step": 0,
        "eval_accuracy": summary["eval_before"],
        "retention_accuracy": summary["retention_before"],
    }
    rows = rows[1:]
    assert len(rows) == 20 and rows[-1]["eval_accuracy"] == summary["eval_after"]
    assert {"eval_before", "eval_after", "retention_before", "retention_after", "steps", "seconds"} <= set(summary)
    assert summary["eval_after"] >= summary["eval_before"] + 0.05  # RL improved held-out accuracy
    early = sum(r["reward_mean"] for r in rows[:5]) / 5
    late = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert late > early
    assert load_config(run_dir / "config.toml") == trainer.cfg  # the resolved config reloads as it was

    # both saved layouts reload onto the base and reproduce the trained policy
    ids = torch.tensor([[1, 5, 6, 7, 76, 8, 9, 10, 84]])
    with torch.no_grad():
        want = trainer.model(ids)
    for layout in ("per_expert", "fused"):
        fresh = load_model(resolve_model_path("tiny-moe"))
        lora.load_adapter(fresh, run_dir / "adapter" / layout)
        with torch.no_grad():
            assert (fresh(ids) - want).abs().max() < 1e-4


def test_mismatch_metrics_without_correction_and_tis_cap(tmp_path):
    _, _, off = run(
        tmp_path,
        "name=off",
        "steps=2",
        "algorithm.mismatch=none",
        "rollout.precision=bf16_weights",
        'task.retention=""',
    )
    rows = [json.loads(line) for line in (off / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(r["mismatch_kl_k3"] > 0 and r["is_ratio_max"] > r["is_ratio_min"] for r in rows)
    assert all(r["is_weight_mean"] == 1.0 for r in rows)  # no correction applied
    _, _, tis = run(
        tmp_path,
        "name=tis",
        "steps=2",
        "algorithm.mismatch=token_tis",
        "algorithm.mismatch_cap=1.001",
        "rollout.precision=bf16_weights",
        'task.retention=""',
    )
    rows = [json.loads(line) for line in (tis / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(r["is_weight_max"] <= 1.001 + 1e-6 and r["is_limited_frac"] > 0 for r in rows)
    _, _, exact = run(tmp_path, "name=exact", "steps=1", "rollout.precision=fp32", 'task.retention=""')
    row = json.loads((exact / "metrics.jsonl").read_text().splitlines()[1])
    # same weights in fp32: only kernel rounding (KV-cache decode vs full forward) remains; seen 2e-9 to
    # 4e-9 on different CPUs, against 6e-5 with bf16-rounded rollout weights
    assert row["mismatch_kl_k3"] < 1e-7


@pytest.mark.parametrize(
    "extra",
    [
        ["algorithm.epochs=2", "algorithm.minibatches=2"],
        ["algorithm.kl_coef=0.1", 'algorithm.aggregation="seq_mean_token_mean"'],
    ],
)
def test_multi_pass_and_kl_paths_run(tmp_path, extra):
    _, summary, run_dir = run(tmp_path, "name=paths", "steps=2", 'task.retention=""', *extra)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    if "algorithm.kl_coef=0.1" in extra:
        assert "kl_ref" in rows[-1]
    else:
        assert rows[-1]["approx_kl_old"] >= 0


def test_a_run_without_learning_signal_warns_and_a_users_dataset_has_no_retention_eval(tmp_path, capsys):
    """A reward that never varies (every sample scores 0): every group's advantages are 0. The run
    says so in the console and in metrics.jsonl (`warning`) and counts it in summary.json; and a
    user's JSONL dataset gets no reversal retention eval unless asked (`task.retention = "auto"`)."""
    data = tmp_path / "sub.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"{a}-{b}=", "answer": "nope"}) + "\n"
            for a, b in zip(range(50, 90), range(10, 50), strict=True)
        )
    )
    options = f'task.options={{path = "{data}", reward_fn = "trillora.tasks.rewards:exact_match"}}'
    trainer, summary, run_dir = run(tmp_path, "name=flat", "task.name=jsonl", options, "steps=6", "eval_every=6")
    assert trainer.retention is None and summary["retention_before"] is None
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "retention_accuracy" not in rows[0]
    warned = [r["step"] for r in rows if "warning" in r]
    assert warned == [5] and "little learning signal" in rows[5]["warning"]  # after a window of 5 steps, once
    assert all(r["groups_all_equal"] == 1.0 for r in rows[1:])
    assert summary["little_signal_warnings"] == 1
    err = capsys.readouterr().err
    assert "warning at step 5" in err
    assert "step 6: reward 0.000  one-reward groups 1.00" in err  # the metrics line of the last step
