"""tinker-cookbook's supervised and RL loops, unchanged, against `trillora serve --tinker`
(through `examples/tinker_cookbook_tiny.py`, which registers the tiny model's tokenizer and
renderer and hands the recipes local 3-digit addition instead of GSM8K / No Robots).

`make test` installs the cookbook and sets TRILLORA_REQUIRE_BENCH=1: a missing cookbook then fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("TRILLORA_REQUIRE_BENCH") != "1":
    pytest.importorskip("tinker_cookbook", reason="make test installs tinker-cookbook (see the Makefile)")

from engine_helpers import tinker_server  # noqa: E402

pytestmark = pytest.mark.slow  # the cookbook's recipes

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tinker_cookbook_tiny.py"
KEY = "tml-cookbook"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from tinker_server(tmp_path_factory.mktemp("state"), KEY)


def recipe(server, *args: str) -> None:
    env = {
        **os.environ,
        "TINKER_API_KEY": KEY,
        "TINKER_BASE_URL": f"http://127.0.0.1:{server.cfg.port}",
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cookbook_supervised_then_rl_loop_run_unchanged(server, tmp_path):
    sl, rl = tmp_path / "sl", tmp_path / "rl"
    recipe(server, "sl", f"log_path={sl}", "batch_size=16", "max_steps=12", "learning_rate=3e-3", "save_every=0")
    metrics = rows(sl / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(12))
    assert metrics[-1]["train_mean_nll"] < 0.7 * metrics[0]["train_mean_nll"]  # the format is learned
    final = rows(sl / "checkpoints.jsonl")[-1]
    assert final["state_path"].startswith("tinker://") and final["sampler_path"].startswith("tinker://")

    recipe(
        server,
        "rl",
        f"log_path={rl}",
        f"start_from={sl}",
        "batch_size=4",
        "group_size=4",
        "max_tokens=32",
        "max_steps=3",
        "learning_rate=1e-3",
        "loss_fn=gspo",
        "save_every=0",
    )
    metrics = rows(rl / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2] and all(0.0 <= m["reward/total"] <= 1.0 for m in metrics)
    assert rows(rl / "checkpoints.jsonl")[-1]["name"] == "final"


def test_rolling_checkpoints_are_deleted_and_periodic_ones_expire(server, tmp_path):
    """The cookbook's full supervised trainer (`supervised/train.py`) with a rolling checkpoint every
    step (each save deletes the one before: a DELETE the server used to answer with a page the SDK
    retried for minutes) and periodic ones with a TTL: what is left is the periodic ones (with their
    expiry) and the final one (with none)."""
    sl = tmp_path / "sl"
    recipe(
        server,
        "train",
        f"log_path={sl}",
        "batch_size=16",
        "max_steps=4",
        "learning_rate=3e-3",
        "save_every=2",
        "rolling_save_every=1",
        "ttl_seconds=3600",
        "lora_rank=8",
    )  # the README's command
    saved = rows(sl / "checkpoints.jsonl")
    run = saved[-1]["state_path"].split("/")[2]
    store = server.tinker.store
    left = {c["tinker_path"]: c for c in store.checkpoints(run)}
    assert saved[-1]["state_path"] in left and left[saved[-1]["state_path"]]["expires_at"] is None  # final: kept
    periodic = [r for r in saved if r["name"] != "final" and r.get("sampler_path")]
    assert periodic and all(left[r["state_path"]]["expires_at"] is not None for r in periodic)  # with their TTL
    weights = sorted(p for p in left if "/weights/" in p)
    rolling = [r["state_path"] for r in saved if not r.get("sampler_path")]
    assert len(rolling) == 2 and not set(rolling) & set(left)  # steps 1 and 3: each deleted by the save after it
    assert set(weights) == {r["state_path"] for r in periodic} | {saved[-1]["state_path"]}


def test_the_full_rl_trainer_runs_async_with_one_documented_argument(server, tmp_path):
    """The cookbook's `rl/train.py` in async mode (sampling one step ahead). Its async default loss,
    `stable_reinforce`, is refused with a 400 naming the alternative (its objective is unpublished);
    `async_config.loss_fn=ppo` is the one argument it takes (the README's command)."""
    log = tmp_path / "rl"
    recipe(
        server,
        "rl-train",
        f"log_path={log}",
        "max_steps=2",
        "async=1",
        "async_config.loss_fn=ppo",
        "eval_every=0",
        "save_every=0",
    )
    metrics = [m for m in rows(log / "metrics.jsonl") if "async/staleness_max" in m]
    assert [m["step"] for m in metrics] == [0, 1] and all(m["async/staleness_max"] <= 1 for m in metrics)


def test_the_registered_renderer_writes_what_the_chat_template_writes():
    sys.path.insert(0, str(EXAMPLE.parent))
    import tinker_cookbook_tiny as example
    from tinker_cookbook import renderers

    example.register()
    tok = example.tokenizer()
    renderer = renderers.get_renderer(example.RENDERER, tok)
    convo = [
        {"role": "user", "content": "How many a's are in banana?"},
        {"role": "assistant", "content": "\\boxed{3}"},
        {"role": "user", "content": "123+456="},
    ]
    want = tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=False)
    assert tok.decode(renderer.build_generation_prompt(convo).to_ints()) == want
    tokens, weights = renderer.build_supervised_example([*convo, {"role": "assistant", "content": "\\boxed{579}"}])
    full = tok.apply_chat_template([*convo, {"role": "assistant", "content": "\\boxed{579}"}], tokenize=False)
    assert tok.decode(tokens.to_ints()) == full
    assert (
        tok.decode([t for t, w in zip(tokens.to_ints(), weights.tolist(), strict=True) if w > 0])
        == "\\boxed{579}<|im_end|>"
    )


def test_the_committed_cookbook_curve_rises_as_the_readme_says():
    """The full-size run (`benchmarks/cookbook_reward.py`, minutes: too long for the suite) as
    committed: the RL loop's reward over its last 10 steps well above its first 10, at the
    settings and figures the README gives."""
    root = Path(__file__).resolve().parents[1]
    r = json.loads((root / "benchmarks" / "results" / "cookbook_reward.json").read_text())
    assert r["model"] == "tiny-moe-chat" and r["settings"]["rl_steps"] == len(r["rl"]["reward"]) == 80
    w = r["rl"]["window"]
    assert r["rl"]["first_mean"] == pytest.approx(sum(r["rl"]["reward"][:w]) / w)
    assert r["rl"]["last_mean"] == pytest.approx(sum(r["rl"]["reward"][-w:]) / w)
    assert r["rl"]["last_mean"] >= r["rl"]["first_mean"] + 0.1
    from docs_pages import TEXT as readme

    assert f"from {r['rl']['first_mean']:.3f} over the first 10 steps to {r['rl']['last_mean']:.3f}" in readme
    assert r["settings"]["rl_lr"] == 5e-4 and "max_steps=80 learning_rate=5e-4 " in readme


def test_the_checkpoint_benchmark_runs_small(tmp_path):
    """`benchmarks/cookbook_checkpoints.py` at 2 steps: every arm's steps timed from the cookbook's own
    spans, the rolling checkpoints gone from the store (the committed run's figures are in the README)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "cookbook_checkpoints.py"
    out = tmp_path / "ckpt.json"
    run = subprocess.run(
        [sys.executable, str(script), "--steps", "2", "--save-every", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["arms"]) == {"no checkpoints", "rolling + periodic", "rolling + periodic, submit_ahead=1"}
    for arm in report["arms"].values():
        assert len(arm["step_seconds"]) == 2 and arm["largest_s"] >= arm["median_s"] > 0
    saving = report["arms"]["rolling + periodic"]
    assert saving["rolling_left"] == 0 and saving["with_expiry"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
