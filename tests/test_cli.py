"""Two-step smoke runs of the CLI recipes, as a user types them (subprocesses, bounded in time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "steps=2",
    "eval_every=2",
    "rollout.prompts_per_step=4",
    "rollout.group_size=2",
    "task.eval_problems=16",
    "task.eval_samples=1",
]


def trillora(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trillora", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


@pytest.mark.parametrize(
    "recipe",
    [None, "examples/arithmetic.toml", "examples/countdown.toml", "examples/jsonl.toml", "examples/guessing.toml"],
)
@pytest.mark.slow
def test_train_recipes_smoke(tmp_path, recipe):
    args = ([recipe] if recipe else []) + [*SMALL, f"out_dir={tmp_path}", "name=smoke"]
    out = trillora("train", *args)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((tmp_path / "smoke" / "summary.json").read_text())
    assert summary["steps"] == 2 and 0.0 <= summary["eval_after"] <= 1.0


@pytest.mark.slow
def test_eval_generate_plot_with_a_trained_adapter(tmp_path):
    assert trillora("train", *SMALL, f"out_dir={tmp_path}", "name=a").returncode == 0
    run = tmp_path / "a"
    ev = trillora(
        "eval",
        "tiny-moe",
        "--adapter",
        str(run / "adapter" / "fused"),
        "--problems",
        "16",
        "--temperature",
        "0",
        "--option",
        "digits=2",
    )
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert 0.0 <= json.loads(ev.stdout)["accuracy"] <= 1.0
    gen = trillora("generate", "tiny-moe", "--adapter", str(run / "adapter" / "per_expert"), "--prompt", "rev abc=")
    assert gen.returncode == 0 and gen.stdout.startswith("rev abc=")
    plot = trillora("plot", str(run))
    assert plot.returncode == 0 and (run / "overview.png").exists()


def test_train_bad_override_is_one_line_error(tmp_path):
    out = trillora("train", "rollout.temprature=1", f"out_dir={tmp_path}")
    assert out.returncode == 2
    assert "did you mean 'rollout.temperature'?" in out.stderr and "Traceback" not in out.stderr


def test_main_returns_to_its_caller_under_torchrun_env(monkeypatch, capsys):
    """Only the process entry (`trillora`, `python -m trillora`) leaves a torchrun rank with os._exit;
    a script that calls `main()` itself gets the exit code back and goes on."""
    from trillora.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["info", "qwen3-30b-a3b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)


def test_plots_label_metrics_scale_retention_apart_and_mark_a_resume(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trillora.plots import LABELS, _panel

    rows = [{"step": 0, "eval_accuracy": 0.3, "retention_accuracy": 0.99}]
    rows += [{"step": s, "mismatch_kl_k1": (-1) ** s * 1e-3, "mismatch_kl_k3": 1e-3} for s in range(1, 6)]
    rows += [{"step": 6, "eval_accuracy": 0.5, "retention_accuracy": 0.98}]
    fig, (acc, kl) = plt.subplots(1, 2)
    _panel(acc, rows, ("eval_accuracy", "retention_accuracy"), "accuracy", resumed=[3])
    _panel(kl, rows, ("mismatch_kl_k1", "mismatch_kl_k3"), "kl", resumed=[])
    right = [a for a in fig.axes if a not in (acc, kl)]
    assert len(right) == 1 and right[0].get_ylim() == (0, 1.05)  # retention on its own whole scale
    assert acc.get_ylim()[0] > 0.2  # the task's curve keeps its own scale
    assert [t.get_text() for t in acc.get_legend().get_texts()] == [
        LABELS["eval_accuracy"],
        LABELS["retention_accuracy"],
        "resumed at step 3",
    ]
    assert any(list(line.get_ydata()) == [0, 0] for line in kl.lines)  # a zero line: k1 goes below 0
    assert "below 0" in kl.get_legend().get_texts()[0].get_text()
    plt.close(fig)


def test_serve_flags_are_the_serve_config_fields():
    """One definition: each ServeConfig field is a flag of its own name, with its default, and the
    parsed flags give the config (`cli.flags`)."""
    import dataclasses

    from trillora.cli import build_parser
    from trillora.cli.flags import config_of
    from trillora.parallel import ParallelDims
    from trillora.serve.config import ServeConfig

    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    flags = {a.dest for a in serve._actions} - {"help", "learn"}
    layout = {f.name for f in dataclasses.fields(ParallelDims)} - {"dp", "pp_schedule", "pp_stage_layers"}
    assert flags == {f.name for f in dataclasses.fields(ServeConfig)} - {"parallel"} | layout  # --tp, not --parallel-tp
    assert config_of(ServeConfig, parser.parse_args(["serve", "tiny-moe"])) == ServeConfig(model="tiny-moe")
    args = parser.parse_args(
        ["serve", "tiny-moe-chat", "--tinker", "--api-key", "a", "--api-key", "b", "--tp", "2", "--sp"]
        + ["--max-state-gib", "0.5", "--precision", "bf16_weights", "--adapter-memory-mib", "12"]
    )
    cfg = config_of(ServeConfig, args)
    assert (cfg.model, cfg.tinker, cfg.api_key) == ("tiny-moe-chat", True, ["a", "b"])
    assert cfg.parallel == ParallelDims(dp=0, tp=2, sp=True)  # the trainer's layout type, its defaults
    assert (cfg.max_state_gib, cfg.precision, cfg.adapter_memory_mib) == (0.5, "bf16_weights", 12.0)
    with pytest.raises(SystemExit):  # a value outside the field's Literal is refused by the parser
        parser.parse_args(["serve", "tiny-moe", "--expert-rank-rule", "half"])
