"""A task makes prompts and scores completions; it knows nothing of models or trainers.

Problems are generated from a seed, and the held-out split is fixed by the problem itself
(a hash of its prompt), so train and eval never share a problem whatever the seeds.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import random
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

SPLITS = ("train", "eval")


@dataclass(frozen=True, kw_only=True)
class Problem:
    prompt: str
    answer: str
    data: dict[str, Any] = field(default_factory=dict)
    messages: list[dict] | None = field(default=None, hash=False)
    """Chat messages, for a chat-formatted row: the prompt is their chat-template rendering."""


def in_eval_split(prompt: str, eval_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return (h % 10_000) < eval_fraction * 10_000


MOVED = {
    f"trillora.tasks.{env}": f"trillora.envs.{env}"
    for env in ("guessing", "ledger", "marathon", "calculator", "python_tool", "tools", "env_dataset")
}
"""Built-in envs that configs written before the `envs` package name under `trillora.tasks`."""


def load_callable(spec: str, what: str) -> Callable:
    """User code named as 'module:function' (a reward, an env dataset), imported now so a typo fails at start."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"{what} {spec!r} must be given as 'module:function'")
    module = MOVED.get(module, module)
    if "" not in sys.path and os.getcwd() not in sys.path:  # the console script, unlike `python -m`, leaves the
        sys.path.append(os.getcwd())  # working folder off the path: a module beside the run is found either way
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{what} {spec!r} cannot be imported: {e}") from None
    if not callable(fn):
        raise ConfigError(f"{what} {spec!r} is not callable")
    return fn


def first_line(completion: str) -> str:
    """The answer part of a completion: up to the first newline, stripped."""
    return completion.split("\n", 1)[0].strip()


class Task(ABC):
    name: str = "task"
    eval_fraction: float = 0.1
    chat: bool = False
    """Prompts are chat messages (rendered with the tokenizer's chat template)."""
    reward_is_ours: bool = False
    """The reward is trillora's own arithmetic on strings (a built-in task's), which cannot hang: it
    runs without a timer. User rewards (JSONL, code) keep `task.reward_timeout`."""

    @abstractmethod
    def sample(self, rng: random.Random) -> Problem:
        """One random problem (either split)."""

    @abstractmethod
    def reward(self, problem: Problem, completion: str) -> float:
        """Score in [0, 1]; an unparsable completion scores 0, never raises."""

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        if split not in SPLITS:
            raise ValueError(f"split {split!r}; allowed: {', '.join(SPLITS)}")
        rng = random.Random(f"{self.name}:{split}:{seed}")
        out, tries = [], 0
        while len(out) < n:
            p = self.sample(rng)
            tries += 1
            if in_eval_split(p.prompt, self.eval_fraction) == (split == "eval"):
                out.append(p)
            if tries > 1000 * n:
                raise RuntimeError(f"task {self.name}: cannot draw {n} {split} problems")
        return out
