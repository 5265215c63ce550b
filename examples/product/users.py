"""Simulated users with hidden goals: each needs the product of two numbers (4 digits × 3), asks
the assistant in the form the model knows (`a*b=`), and is satisfied when the answer's first
integer is the product. Training users send a thumbs up (1) or down (0), retry a wrong answer
once and come back later with the same need (tasks recur, as in real traffic); held-out users ask questions of the
split the chat
model never saw in pretraining and send nothing."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from trillora.envs.calculator import draw

_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class User:
    name: str
    a: int
    b: int

    @property
    def question(self) -> str:
        return f"{self.a}*{self.b}="

    def satisfied(self, answer: str) -> bool:
        found = _INTEGER.search(answer)
        return found is not None and int(found.group()) == self.a * self.b


def users(split: str, n: int, seed: int) -> list[User]:
    """n users of the train or eval split (the calculator env's held-out hash split)."""
    rng = random.Random(f"product:{split}:{seed}")
    return [User(f"{split}-{i}", *draw(rng, (4, 3), split)) for i in range(n)]
