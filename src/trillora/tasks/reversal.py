"""Generated string reversal `rev abc=` -> `cba`: the "general" skill that RL on other tasks
must not erase (the retention metric)."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from .base import Problem, Task, first_line


@dataclass
class ReversalTask(Task):
    reward_is_ours = True
    min_len: int = 3
    max_len: int = 5
    name: str = "reversal"

    def sample(self, rng: random.Random) -> Problem:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(self.min_len, self.max_len)))
        return Problem(prompt=f"rev {word}=", answer=word[::-1])

    def reward(self, problem: Problem, completion: str) -> float:
        return float(first_line(completion) == problem.answer)
