"""The built-in tool envs: the calculator and the Python tool (through the sandbox, attacked as a
model's program would). RL on the calculator from its example config runs in test_benchmarks.py
(benchmarks/agent_envs.py, a step)."""

from __future__ import annotations

import json

import pytest

from trillora.envs import calculator
from trillora.envs.python_tool import dataset as python_dataset
from trillora.envs.python_tool import make_python_tool, puzzle
from trillora.sandbox.jail import Limits
from trillora.tiny import build_chat_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def call(name: str, **args) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call><|im_end|>"


def _factors(group) -> tuple[int, int]:
    """The factors a calculator group's envs ask about ("a*b=")."""
    a, b = group.make_envs()[0].messages[0]["content"].removesuffix("=").split("*")
    return int(a), int(b)


def test_calculator_batches_are_deterministic_and_held_out(tok):
    ds = calculator.dataset(tok, batch_size=4, group_size=3, eval_size=16, seed=0)
    first = [_factors(g) for g in ds.get_batch(5)]
    assert first == [_factors(g) for g in ds.get_batch(5)] and first != [_factors(g) for g in ds.get_batch(6)]
    assert all(1000 <= a <= 9999 and 100 <= b <= 999 for a, b in first)
    train = {_factors(g) for i in range(50) for g in ds.get_batch(i)}
    held = {_factors(g) for g in ds.eval_batch()}
    assert len(held) == 16 and not train & held
    [env, *_] = ds.get_batch(5)[0].make_envs()
    env.initial_observation()
    a, b = first[0]
    assert env.step(encode(tok, call("multiply", a=a, b=b))).next_observation[-30:]  # the tool answered
    assert str(a * b) in env.messages[-1]["content"]
    assert env.step(encode(tok, f"{a * b}<|im_end|>")).reward == 1.0


def test_python_tool_runs_programs_in_the_sandbox(tok):
    question, answer = puzzle(__import__("random").Random(1))
    ds = python_dataset(tok, batch_size=1, group_size=1, eval_size=1, seed=0)
    [env] = ds.get_batch(0)[0].make_envs()
    env.initial_observation()
    assert "python(code)" in tok.decode(env.tokens, skip_special_tokens=False)
    q = env.messages[0]["content"]
    program = {
        "digits": "print(sum(int(d) for d in str({})))",
        "primes": "n={}\nprint(sum(all(k%d for d in range(2,int(k**.5)+1)) for k in range(2,n)))",
        "divisors": "n={}\nprint(sum(d for d in range(1,n+1) if n%d==0))",
    }
    if "digits" in q:
        code = program["digits"].format(q.split("of ")[-1].rstrip("?"))
    elif "primes" in q:
        code = program["primes"].format(q.split("below ")[-1].rstrip("?"))
    else:
        code = program["divisors"].format(q.split("of ")[-1].rstrip("?"))
    result = env.step(encode(tok, call("python", code=code)))
    assert result.metrics["tool_error"] == 0.0
    printed = env.messages[-1]["content"].strip()
    assert env.step(encode(tok, f"It is {printed}.<|im_end|>")).reward == 1.0
    assert question and answer  # puzzles have integer answers


@pytest.mark.slow
def test_python_tool_contains_hostile_programs():
    python = make_python_tool(Limits(cpu_seconds=1, wall_seconds=2.0))
    net = python("import socket\ns = socket.create_connection(('1.1.1.1', 53), timeout=1)\nprint('connected')")
    assert net.startswith("error: exit status 1") and "connected" not in net
    assert python("while True: pass").startswith("error: the program was stopped (SIGXCPU)")
    assert python("import time\ntime.sleep(30)").startswith("error: the program was stopped (SIGKILL)")
    assert python("print(open('/proc/self/status').read().count('\\n') > 0)") == "True\n"
