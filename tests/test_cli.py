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
