"""The commands of the README and of docs/getting-started.md ("Using it"), run as written, in order, in a fresh folder:
every `trillora`
command through the installed console script. A training command runs until its first RL step is
logged and is then stopped with SIGTERM, the way a user stops a run (it saves a checkpoint and
the adapter so far, and exits 0): the full default job is what `make demo` runs. The commands
after it read that run's adapter and metrics, as the README has them do.

Not run here: `python -m trillora.tiny build` (minutes of pretraining that rewrites the shipped
checkpoint inside the package; `make tiny-moe` runs it)."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from docs_pages import bash_block

pytestmark = pytest.mark.slow  # the README's commands, training included

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = {"python -m trillora.tiny build"}


def using_it() -> list[str]:
    return bash_block("Using it")


def first_step_logged(folder: Path, since: float) -> bool:
    for metrics in folder.glob("runs/*/metrics.jsonl"):
        if metrics.stat().st_mtime >= since and any("reward_mean" in line for line in metrics.read_text().splitlines()):
            return True
    return False


def run_training(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    since = time.time()
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 900
    while not first_step_logged(cwd, since):
        assert proc.poll() is None, f"{argv} ended before its first step: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"{argv}: no step logged in 900 s"
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_the_using_it_commands_run_as_written(tmp_path):
    commands = using_it()
    assert commands[0] == "trillora train" and len(commands) >= 8
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    trillora = Path(sys.executable).parent / "trillora"  # the console script the install put beside python
    assert trillora.exists()
    ran = []
    for command in commands:
        if command in SKIPPED:
            continue
        words = shlex.split(command)
        assert words[0] == "trillora", command
        argv = [str(trillora), *words[1:]]
        if words[1] == "train":
            out = run_training(argv, tmp_path)
            assert out.returncode == 143 and "stopped at step" in out.stderr, (command, out.stderr[-3000:])
        else:
            out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900)
            assert out.returncode == 0, (command, out.stderr[-3000:])
        ran.append((words[1], out.stdout))
    assert [w for w, _ in ran] == ["train"] * 4 + ["eval", "generate", "info", "plot"]
    outputs = dict(ran[4:])
    assert 0.0 <= json.loads(outputs["eval"])["accuracy"] <= 1.0
    assert outputs["generate"].startswith("317+684=")
    assert "kimi" in outputs["info"].lower()
    assert (tmp_path / "runs" / "default" / "overview.png").exists()
    for layout in ("fused", "per_expert"):
        assert (tmp_path / "runs" / "default" / "adapter" / layout / "adapter_model.safetensors").exists()


def test_the_vllm_command_runs_as_written(tmp_path):
    """`trillora train rollout.engine=vllm` on the default job: vLLM in this process, the context
    the model allows (the `vllm` extra, which `make test` installs)."""
    import os

    import pytest

    if os.environ.get("TRILLORA_REQUIRE_BENCH") != "1":
        pytest.importorskip("vllm")
    commands = bash_block("vLLM rollouts")
    assert commands == [
        "make setup-vllm",
        "trillora train rollout.engine=vllm",
    ]  # the first is this environment's setup
    out = run_training([str(Path(sys.executable).parent / "trillora"), *shlex.split(commands[1])[1:]], tmp_path)
    assert out.returncode == 143 and "stopped at step" in out.stderr, out.stderr[-3000:]
    (row,) = [json.loads(x) for x in (tmp_path / "runs/default/metrics.jsonl").read_text().splitlines()[1:2]]
    assert row["step"] == 1 and "mismatch_kl_k3" in row


def test_the_three_ways_in_run_as_written(tmp_path):
    """The README's "Three ways in": each training command until its first logged step (then
    stopped, as a user stops a run), the server as written (on a free port, appended: the last
    --port wins) answering the SDK's health check with its key, and the plan."""
    import os
    import re
    import urllib.request

    from docs_pages import after
    from engine_helpers import serve_process

    section = after("Three ways in").split("\n## ", 1)[0]
    blocks = [
        [line.split("  #")[0].strip() for line in b.splitlines() if line.strip()]
        for b in re.findall(r"```bash\n(.*?)\n```", section, re.S)
    ]
    (train_a, train_b), (serve,), (plan,) = blocks
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    trillora = str(Path(sys.executable).parent / "trillora")
    for command in (train_a, train_b):
        out = run_training([trillora, *shlex.split(command)[1:]], tmp_path)
        assert out.returncode == 143 and "stopped at step" in out.stderr, (command, out.stderr[-3000:])
    assert (tmp_path / "runs" / "jsonl" / "adapter").is_dir() and (tmp_path / "runs" / "guessing" / "adapter").is_dir()
    words = shlex.split(serve)
    proc, url = serve_process(words[1:], cwd=tmp_path)
    try:
        key = words[words.index("--api-key") + 1]
        request = urllib.request.Request(
            f"{url}/api/v1/create_session",
            data=b"{}",
            method="POST",
            headers={"X-API-Key": key, "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as r:  # the Tinker route, with the key as written
            assert r.status == 200 and "session_id" in json.loads(r.read())
        # docs/tinker.md's SDK snippet, as written, against it
        snippet = (
            after("The Tinker API: `trillora serve MODEL --tinker`").split("```python\n", 1)[1].split("\n```", 1)[0]
        )
        (tmp_path / "snippet.py").write_text(snippet)
        env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0"}
        out = subprocess.run(
            [sys.executable, "snippet.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert out.returncode == 0, out.stderr[-3000:]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    out = subprocess.run([trillora, *shlex.split(plan)[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "LoRA vs full-parameter: at least" in out.stdout, out.stderr[-3000:]


def test_your_own_dataset_runs_as_the_docs_write_it(tmp_path):
    """docs/getting-started.md's reward module and TOML, as written, in a fresh folder with a JSONL
    file of its rows: `trillora train my_task.toml` (the console script, which must find the
    module beside the run) trains until its first step is logged."""
    import re

    from docs_pages import after

    section = after("Your own dataset and reward").split("\n## ", 1)[0]
    python = re.search(r"```python\n(.*?)\n```", section, re.S).group(1)
    toml = re.search(r"```toml\n(.*?)\n```", section, re.S).group(1)
    (tmp_path / "my_reward.py").write_text(python)
    (tmp_path / "my_task.toml").write_text(toml)
    (tmp_path / "data").mkdir()
    rows = [
        {"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in zip(range(100, 160), range(300, 360), strict=True)
    ]
    (tmp_path / "data" / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run_training([str(Path(sys.executable).parent / "trillora"), "train", "my_task.toml"], tmp_path)
    assert out.returncode == 143 and "stopped at step" in out.stderr, out.stderr[-3000:]
    assert (tmp_path / "runs" / "mine" / "adapter" / "fused" / "adapter_model.safetensors").exists()
