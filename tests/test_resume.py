"""Checkpoints and resume: atomic folders, a `latest` pointer, damaged ones passed over, and a run
killed with SIGKILL ten times ending with the same adapter, bit for bit, as one never killed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trillora.checkpoint import train_state

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # killed and resumed training runs, torchrun

FAST = [
    "rollout.prompts_per_step=8",
    "rollout.group_size=4",
    "task.eval_problems=16",
    "task.eval_samples=1",
    'task.retention=""',
    "deterministic=true",
]


def train(out_dir: Path, name: str, *overrides: str, ranks: int = 1, wait: bool = True):
    args = ["-m", "trillora", "train", f"name={name}", f"out_dir={out_dir}", *FAST, *overrides]
    if ranks > 1:
        from engine_helpers import free_port

        cmd = [
            str(Path(sys.executable).parent / "torchrun"),
            "--nproc-per-node",
            str(ranks),
            "--master-port",
            str(free_port()),
            *args,
        ]
    else:
        cmd = [sys.executable, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    return err


def adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "adapter" / "fused" / "adapter_model.safetensors"))


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_checkpoints_every_k_keep_n_and_a_damaged_one_is_passed_over(tmp_path):
    train(tmp_path, "run", "steps=6", "eval_every=3", "checkpoint.every=2", "checkpoint.keep=2")
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000004", "step-000006"]
    assert (root / "latest").read_text().strip() == "step-000006"
    state = json.loads((root / "step-000006" / "state.json").read_text())
    assert state["step"] == 6 and "python" in state["rng"] and state["layout"] == {"world": 1}
    ckpt = load_file(str(root / "step-000006" / "rank-0.safetensors"))
    assert any(k.endswith(".exp_avg_sq") for k in ckpt) and "rng.torch" in ckpt
    assert (root / "step-000006" / "adapter" / "adapter_config.json").is_file()
    assert len((root / "step-000006" / "metrics.jsonl").read_text().splitlines()) == 7  # step 0 + six steps

    (root / ".step-000008.partial").mkdir()  # a save cut short
    rank_file = root / "step-000006" / "rank-0.safetensors"
    rank_file.write_bytes(rank_file.read_bytes()[:-100])  # a damaged newest checkpoint
    found = train_state.find_latest(root)
    assert found.path == root / "step-000004"
    assert any("half-written" in s and ".step-000008.partial" in s for s in found.skipped)
    assert any("rank-0.safetensors: does not match its manifest" in s for s in found.skipped)

    err = train(tmp_path, "run", "steps=8", "eval_every=3", "checkpoint.every=2", "checkpoint.keep=2", "--resume")
    assert "resuming from" in err and "step-000004" in err and "does not match its manifest" in err
    assert not list(root.glob(".step-*.partial"))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(9))  # the metrics of steps 5 and 6 were rewritten, not doubled


def test_a_fresh_run_moves_earlier_checkpoints_aside(tmp_path):
    train(tmp_path, "run", "steps=2", "eval_every=2")
    train(tmp_path, "run", "steps=1", "eval_every=1")
    assert (tmp_path / "run" / "checkpoints.previous" / "step-000002").is_dir()
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")] == ["step-000001"]


def test_sigterm_saves_and_stops_after_the_step(tmp_path):
    proc = train(tmp_path, "run", "steps=400", "eval_every=400", "checkpoint.every=0", wait=False)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]  # 143: stopped, not finished
    found = train_state.find_latest(tmp_path / "run" / "checkpoints")
    step = json.loads((found.path / "state.json").read_text())["step"]
    assert 2 <= step < 400 and f"stopped at step {step} of 400" in err
    assert len(metrics.read_text().splitlines()) == step + 1


def stalling_run(tmp_path: Path, name: str, *more: str) -> tuple[subprocess.Popen, Path]:
    """A JSONL run whose reward sleeps ten minutes once `stall` exists (tests/reward_fns.py)."""
    stall = tmp_path / "stall"
    options = (
        f'task.options={{path = "{ROOT / "examples/data/addition.jsonl"}", reward_fn = "reward_fns:stalls_when_told"}}'
    )
    cmd = [sys.executable, "-m", "trillora", "train", f"name={name}", f"out_dir={tmp_path}", *FAST, "task.name=jsonl"]
    cmd += [options, "task.reward_timeout=0", "steps=400", "eval_every=400", "checkpoint.every=0", *more]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRILLORA_TEST_STALL": str(stall)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = tmp_path / name / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    return proc, stall


def test_ctrl_c_saves_stops_after_the_step_and_exits_130(tmp_path):
    """And the plots follow a run as it goes (`logging.plot_seconds`), not only when it ends."""
    proc, _ = stalling_run(tmp_path, "run", "logging.plot_seconds=0")
    assert (tmp_path / "run" / "overview.png").is_file() and (tmp_path / "run" / "reward.png").is_file()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    step = json.loads((train_state.find_latest(tmp_path / "run" / "checkpoints").path / "state.json").read_text())
    assert f"stopped at step {step['step']} of 400" in err and (tmp_path / "run" / "adapter").is_dir()


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    """The first Ctrl-C waits for the step in progress; the second does not: here the step's reward
    sleeps ten minutes, and the run must end long before that, with 130 and no new checkpoint."""
    proc, stall = stalling_run(tmp_path, "run")
    stall.touch()
    deadline = time.time() + 300
    while not Path(f"{stall}.asleep").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)  # the reward would hold it 600 s
    assert proc.returncode == 130 and "interrupted" in err, err[-3000:]
    assert "stopped at step" not in err


def test_a_run_folder_in_use_refuses_a_second_writer(tmp_path):
    """`make demo` twice, or two runs with one name and out_dir: the second is refused with the
    first's pid, and the first's metrics hold every step once."""
    first, stall = stalling_run(tmp_path, "run")
    second = subprocess.run(
        [sys.executable, "-m", "trillora", "train", "name=run", f"out_dir={tmp_path}", *FAST, "steps=2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 2 and f"in use by process {first.pid}" in second.stderr, second.stderr
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=300)
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(len(steps)))
    # the lock went with its process: the folder takes a new run (a SIGKILLed one would free it alike)
    third = subprocess.run(
        [sys.executable, "-m", "trillora", "train", "name=run", f"out_dir={tmp_path}", *FAST, "steps=1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert third.returncode == 0, third.stderr[-3000:]


def test_sigkill_ten_times_then_resume_ends_bit_identical(tmp_path):
    """The crash test: killed during rollouts, updates and checkpoint writes, resumed each time."""
    steps = ["steps=24", "eval_every=8", "checkpoint.every=1", "checkpoint.keep=2"]
    train(tmp_path, "whole", *steps)
    rng = random.Random(0)
    root = tmp_path / "killed" / "checkpoints"
    metrics = tmp_path / "killed" / "metrics.jsonl"
    moments = ["step", "step", "step", "write", "step", "write", "step", "write", "step", "write"]
    kills = []
    for moment in moments:
        proc = train(tmp_path, "killed", *steps, "resume=true", wait=False)
        done_before = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        deadline = time.time() + 300
        while proc.poll() is None and time.time() < deadline:
            rows = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            if moment == "write" and rows > done_before and list(root.glob(".step-*.partial")):
                break  # a checkpoint is being written right now
            if moment == "step" and rows > done_before + 1:
                time.sleep(rng.uniform(0.0, 0.15))  # somewhere in a rollout or an update
                break
            time.sleep(0.002)
        if proc.poll() is not None:
            break  # finished before this kill: nothing left to interrupt
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        in_write = bool(list(root.glob(".step-*.partial")))  # the kill landed in a checkpoint write
        found = train_state.find_latest(root)
        if found.path is not None:
            train_state.verify(found.path)  # what the next resume will pick is whole
        kills.append(
            (moment, json.loads((found.path / "state.json").read_text())["step"] if found.path else 0, in_write)
        )
    assert len(kills) == 10, kills
    assert any(w for _, _, w in kills) and kills[-1][1] < 24, kills  # at least one kill cut a write short
    train(tmp_path, "killed", *steps, "resume=true")
    assert_same(adapter(tmp_path / "killed"), adapter(tmp_path / "whole"))
    last = [
        load_file(str(tmp_path / r / "checkpoints" / "step-000024" / "rank-0.safetensors")) for r in ("whole", "killed")
    ]
    assert_same(*last)  # AdamW state and the torch RNG too
    one = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    two = [json.loads(x) for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("loss"), r.get("eval_accuracy"), r.get("flops_total")) for r in one] == [
        (r["step"], r.get("loss"), r.get("eval_accuracy"), r.get("flops_total")) for r in two
    ]  # FLOPs carry over
    assert any("resumed_from" in r for r in two) and not any("resumed_from" in r for r in one)  # marked in the plots


@pytest.mark.parametrize(
    "overrides", [("parallel.dp=2",), ("parallel.ep=2",), ("parallel.pp=2",)], ids=["dp2-fsdp", "dp2xep2", "pp2"]
)
def test_resume_under_torchrun_equals_an_uninterrupted_run(tmp_path, overrides, monkeypatch):
    # every Python process of the launch marks its teardown: torchrun's agent does; the ranks leave
    # without one (`leave_rank`), where gloo's threads freeing a collective's tensors could abort them
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import atexit, os\n"
        "mark = os.path.join(os.environ['TEARDOWN_MARKS'], os.environ.get('RANK', 'agent'))\n"
        "atexit.register(lambda: open(mark, 'w'))\n"
    )
    marks = tmp_path / "marks"
    marks.mkdir()
    with monkeypatch.context() as m:
        m.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
        m.setenv("TEARDOWN_MARKS", str(marks))
        train(tmp_path, "whole", "steps=4", "eval_every=4", *overrides, ranks=2)
    assert sorted(p.name for p in marks.iterdir()) == ["agent"]
    train(tmp_path, "split", "steps=2", "eval_every=4", *overrides, ranks=2)  # stops after 2 steps (a checkpoint)
    assert (tmp_path / "split" / "checkpoints" / "step-000002" / "rank-1.safetensors").is_file()
    err = train(tmp_path, "split", "steps=4", "eval_every=4", "resume=true", *overrides, ranks=2)
    assert "resuming from" in err
    assert_same(adapter(tmp_path / "split"), adapter(tmp_path / "whole"))
    with pytest.raises(AssertionError, match="resume with the same torchrun size"):
        train(tmp_path, "split", "steps=5", "eval_every=4", "resume=true")  # one process cannot take 2 ranks' shards


def test_a_dead_rollout_server_fails_clearly_and_leaves_the_checkpoints_intact(tmp_path):
    from engine_helpers import free_port

    train(tmp_path, "run", "steps=2", "eval_every=2")
    root = tmp_path / "run" / "checkpoints"
    before = {p.name: p.read_bytes() for p in (root / "step-000002").rglob("*") if p.is_file()}
    url = f"http://127.0.0.1:{free_port()}"
    proc = train(
        tmp_path,
        "run",
        "steps=4",
        "eval_every=2",
        "resume=true",
        "rollout.engine=openai",
        f'rollout.urls=["{url}"]',
        wait=False,
    )
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 2 and f"trillora train: error: {url}" in err and "Traceback" not in err
    assert train_state.find_latest(root).path == root / "step-000002"
    assert {p.name: p.read_bytes() for p in (root / "step-000002").rglob("*") if p.is_file()} == before
