"""A Python tool: the policy writes programs, the sandbox runs them (no network, CPU, memory, output
and wall-clock limits: `trillora.sandbox.jail`), their output is the tool's answer. Problems are
integer puzzles that are easy with a program and hard without one (digit sums of big powers,
counts of primes, sums of divisors).

    task.name = "env"
    task.options = { env = "trillora.envs.python_tool:dataset" }
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

from ..chat.renderer import ChatRenderer
from ..sandbox.jail import Limits, run_python
from ..tasks.base import in_eval_split
from .env import RepeatGroup
from .env_dataset import SeededDataset
from .tools import ToolEnv

_INTEGER = re.compile(r"-?\d+")


def make_python_tool(limits: Limits | None = None) -> Callable[[str], str]:
    limits = limits or Limits()

    def python(code: str) -> str:
        """Run a Python program and return what it prints.

        Args:
            code: the program; print the result
        """
        result = run_python(code, limits=limits)
        if result.timed_out or result.signal_name:
            return f"error: the program was stopped ({result.signal_name})\n{result.stderr[-500:]}"
        if result.returncode != 0:
            return f"error: exit status {result.returncode}\n{result.stderr[-500:]}"
        return result.stdout

    return python


def _digit_sum(n: int) -> int:
    return sum(int(d) for d in str(n))


def _primes_below(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\x00\x00"[:n]
    for p in range(2, int(n**0.5) + 1):
        if sieve[p]:
            sieve[p * p :: p] = bytearray(len(range(p * p, n, p)))
    return sum(sieve)


def puzzle(rng: random.Random) -> tuple[str, int]:
    """(question, answer)."""
    kind = rng.randrange(3)
    if kind == 0:
        b, e = rng.randint(2, 9), rng.randint(20, 90)
        return f"What is the sum of the digits of {b}**{e}?", _digit_sum(b**e)
    if kind == 1:
        n = rng.randint(1000, 50000)
        return f"How many primes are below {n}?", _primes_below(n)
    n = rng.randint(1000, 99999)
    return f"What is the sum of the divisors of {n}?", sum(d for d in range(1, n + 1) if n % d == 0)


def _score(answer: int) -> Callable[[str], float]:
    def score(text: str) -> float:
        found = _INTEGER.findall(text)
        return float(bool(found) and int(found[-1]) == answer)

    return score


def dataset(
    tokenizer,
    batch_size: int,
    group_size: int,
    eval_size: int,
    seed: int,
    tool_format: str | None = None,
    max_tool_calls: int = 3,
    cpu_seconds: int = 2,
    wall_seconds: float = 5.0,
) -> SeededDataset:
    limits = Limits(cpu_seconds=cpu_seconds, wall_seconds=wall_seconds)
    renderer = ChatRenderer(tokenizer, tool_format)

    tool = make_python_tool(limits)

    def draw(rng: random.Random, split: str, size: int) -> RepeatGroup:
        while True:  # a puzzle whose question falls in `split`
            q, a = puzzle(rng)
            if in_eval_split(q, 0.1) == (split == "eval"):
                break

        def make() -> ToolEnv:
            asked = [{"role": "user", "content": q}]
            return ToolEnv(renderer, asked, [tool], _score(a), max_tool_calls, tool_timeout=limits.wall_seconds + 5)

        return RepeatGroup(make, size, ("python",))

    return SeededDataset("python", draw, batch_size, group_size, eval_size, seed)
