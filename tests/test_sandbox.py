"""The code sandbox stops an infinite loop, a memory bomb, a network attempt, a sleeper and an output
flood; the code-execution task scores programs with it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from trillora.sandbox.jail import Limits, run_python
from trillora.tasks import make_task
from trillora.tasks.code import passes_tests, program_of

FAST = Limits(cpu_seconds=1, wall_seconds=3.0)


def test_a_normal_program_runs():
    r = run_python("a, b = map(int, input().split())\nprint(a * b)", "6 7\n", FAST)
    assert r.ok and r.stdout == "42\n" and r.signal_name is None


def test_an_infinite_loop_is_stopped_by_the_cpu_limit():
    r = run_python("while True:\n    pass\n", limits=FAST)
    assert not r.ok and r.signal_name == "SIGXCPU"


def test_a_sleeping_program_is_killed_at_the_wall_clock():
    r = run_python("import time\ntime.sleep(60)\n", limits=Limits(cpu_seconds=1, wall_seconds=0.5))
    assert r.timed_out and r.signal_name == "SIGKILL"


def test_a_memory_bomb_gets_memory_error():
    r = run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(64 * 2**20))\n", limits=FAST)
    assert not r.ok and "MemoryError" in r.stderr


def test_the_network_is_unreachable_even_to_a_listening_loopback_server():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')\n"
        r = run_python(code, limits=FAST)
        plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    finally:
        server.close()
    assert plain.stdout.strip() == "connected"  # the same program outside the sandbox reaches it
    assert not r.ok and "connected" not in r.stdout and "Network is unreachable" in r.stderr


def test_an_output_flood_is_cut_by_the_file_size_limit():
    r = run_python("while True:\n    print('x' * 4096)\n", limits=FAST)
    assert not r.ok and len(r.stdout) <= FAST.output_bytes and "File too large" in r.stderr


@pytest.mark.slow
def test_code_task_scores_programs_in_the_sandbox():
    task = make_task("code", tests=3)
    problem = task.problems("train", 1, seed=3)[0]
    assert problem.prompt.startswith("# Python 3: read two integers") and len(problem.data["tests"]) == 3
    assert task.reward(problem, f"```python\n{problem.answer}```") == 1.0
    assert task.reward(problem, "print(0)\n") < 1.0
    assert task.reward(problem, "while True: pass") == 0.0
    assert task.problems("train", 4, seed=3) == task.problems("train", 4, seed=3)
    partial = {"prompt": "p", "tests": [{"stdin": "1 2\n", "stdout": "3"}, {"stdin": "2 2\n", "stdout": "5"}]}
    assert passes_tests("a, b = map(int, input().split())\nprint(a + b)", partial) == 0.5
    assert program_of("text\n```py\nprint(1)\n```\nmore") == "print(1)\n"
    with pytest.raises(ValueError, match="'tests' must be a list"):
        passes_tests("print(1)", {"prompt": "p", "tests": "none"})


@pytest.mark.slow
def test_train_runs_the_code_task(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "trillora",
            "train",
            f"out_dir={tmp_path}",
            "name=code",
            "task.name=code",
            "task.options={tests = 2}",
            'task.retention=""',
            "steps=1",
            "eval_every=1",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=8",
            "task.eval_problems=2",
            "task.eval_samples=1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((tmp_path / "code" / "summary.json").read_text())
    assert summary["steps"] == 1 and 0.0 <= summary["eval_after"] <= 1.0
