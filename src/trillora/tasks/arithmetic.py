"""Generated arithmetic: `123+456=` -> `579`."""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import Problem, Task, first_line


@dataclass
class ArithmeticTask(Task):
    reward_is_ours = True
    digits: int = 3
    ops: tuple[str, ...] = ("+",)
    name: str = "arithmetic"

    def __post_init__(self) -> None:
        bad = [o for o in self.ops if o not in ("+", "-", "*")]
        if bad or not self.ops:
            raise ValueError(f"arithmetic ops {self.ops}; allowed: '+', '-', '*'")
        if not 1 <= self.digits <= 6:
            raise ValueError(f"arithmetic digits={self.digits}; allowed: 1..6")

    def sample(self, rng: random.Random) -> Problem:
        hi = 10**self.digits - 1
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(self.ops)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return Problem(prompt=f"{a}{op}{b}=", answer=str(value))

    def reward(self, problem: Problem, completion: str) -> float:
        return float(first_line(completion) == problem.answer)
