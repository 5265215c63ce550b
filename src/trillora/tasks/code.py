"""Programs as completions: the model writes a Python program that reads stdin and prints the answer;
the reward runs it in `sandbox` on the problem's test inputs and scores the fraction it gets right.

`CodeTask` generates problems (two integers in, one value out: sum, difference, product, maximum,
minimum, integer quotient, remainder). JSONL datasets of programming problems use the same scoring
through `task.name=jsonl` with `reward_fn = "trillora.tasks.code:passes_tests"` and rows
`{"prompt": ..., "tests": [{"stdin": ..., "stdout": ...}, ...]}`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from ..sandbox.jail import Limits, run_python
from .base import Problem, Task

OPERATIONS = {
    "sum": ("a + b", lambda a, b: a + b),
    "difference": ("a - b", lambda a, b: a - b),
    "product": ("a * b", lambda a, b: a * b),
    "maximum": ("max(a, b)", max),
    "minimum": ("min(a, b)", min),
    "integer quotient": ("a // b", lambda a, b: a // b),
    "remainder": ("a % b", lambda a, b: a % b),
}
FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)(?:```|$)", re.DOTALL)


def program_of(completion: str) -> str:
    """The code in a completion: the first fenced block if there is one, else all of it."""
    m = FENCE.search(completion)
    return m.group(1) if m else completion


def score_program(code: str, tests: list[dict], limits: Limits | None = None) -> float:
    """Fraction of tests whose stdout (stripped) the program reproduces; a crash or a limit scores 0."""
    limits = limits or Limits()
    if not tests:
        raise ValueError("a programming problem needs at least one test")
    passed = 0
    for t in tests:
        r = run_python(code, t.get("stdin", ""), limits)
        passed += r.ok and r.stdout.strip() == str(t["stdout"]).strip()
    return passed / len(tests)


def passes_tests(completion: str, row: dict) -> float:
    """Reward for JSONL rows with `tests`: the program in the completion against them."""
    tests = row.get("tests")
    if not isinstance(tests, list) or not all(isinstance(t, dict) and "stdout" in t for t in tests):
        raise ValueError(f"row {row.get('prompt', '')!r}: 'tests' must be a list of {{stdin, stdout}} objects")
    return score_program(program_of(completion), tests)


@dataclass
class CodeTask(Task):
    tests: int = 3
    cpu_seconds: int = 2
    wall_seconds: float = 5.0
    name: str = "code"

    def sample(self, rng: random.Random) -> Problem:
        what = rng.choice(sorted(OPERATIONS))
        expr, fn = OPERATIONS[what]
        pairs = [(rng.randint(-99, 99), rng.randint(1, 99)) for _ in range(self.tests)]
        prompt = f"# Python 3: read two integers a and b from one line of standard input and print their {what}.\n"
        reference = f"a, b = map(int, input().split())\nprint({expr})\n"
        tests = [{"stdin": f"{a} {b}\n", "stdout": str(fn(a, b))} for a, b in pairs]
        return Problem(
            prompt=prompt + "".join(f"# {t['stdin'].strip()} -> {t['stdout']}\n" for t in tests[:1]),
            answer=reference,
            data={"tests": tests},
        )

    def reward(self, problem: Problem, completion: str) -> float:
        limits = Limits(cpu_seconds=self.cpu_seconds, wall_seconds=self.wall_seconds)
        return score_program(program_of(completion), problem.data["tests"], limits)
