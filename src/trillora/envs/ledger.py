"""A long-horizon env for memory: facts given over many turns among distractors, and at the end a
question about one of the earliest. Reward 1 when the answer is that fact's value.

    task.name = "env"
    task.options = { env = "trillora.envs.ledger:dataset", facts = 6, distractors = 3 }

The first observation only says "remember:"; after the policy's k-th turn (k = 1..facts) the env
shows one fact to keep ("c=4") and `distractors` facts about keys that are never asked (upper
case: "Q=7"); the policy answers anything (its turn ends at the stop token, or after
`max_new_tokens`). Then the env asks about a fact from the first `asked_from` turns ("c?") and
scores the first digit of the answer (`facts` + 2 policy turns: set `task.max_turns` to at least
that). The whole trajectory grows by a line per turn, so with `memory.budget` a fraction of it
the fact asked about has long left a truncated context (the first observation, the task, is all
a memory always keeps): only a memory that keeps what matters (or a model that learns to carry it forward) can answer.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable

from ..tasks.prompts import decode_completion, encode_prompt
from .env import Env, EnvGroupBuilder, StepResult
from .env_dataset import SeededDataset

_DIGIT = re.compile(r"\d")
KEYS, NOISE = string.ascii_lowercase, string.ascii_uppercase


class LedgerEnv(Env):
    def __init__(self, lines: list[str], key: str, value: int, tokenizer):
        self.lines, self.key, self.value, self.tokenizer = lines, key, value, tokenizer
        eos = tokenizer.eos_token_id
        self.stop = [eos] if eos is not None else []
        self.turn = 0
        self.history: list[int] = []

    def _text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def initial_observation(self) -> tuple[list[int], list[int]]:
        self.history = encode_prompt(self.tokenizer, "remember:\n")
        return list(self.history), self.stop

    def step(self, action: list[int]) -> StepResult:
        self.turn += 1
        if self.turn > len(self.lines) + 1:  # the answer to the question
            found = _DIGIT.search(decode_completion(self.tokenizer, action))
            right = found is not None and int(found.group()) == self.value
            return StepResult(float(right), True, [], [], {"answered": float(found is not None)})
        after = f"{self.lines[self.turn - 1]}\n" if self.turn <= len(self.lines) else f"{self.key}?"
        self.history += list(action) + self._text("\n" + after)
        return StepResult(0.0, False, list(self.history), self.stop)


def ledger(rng: random.Random, facts: int, distractors: int, asked_from: int) -> tuple[list[str], str, int]:
    """The lines of one episode (one per turn), the key asked about and its value."""
    keys = rng.sample(KEYS, facts)
    values = [rng.randint(0, 9) for _ in keys]
    lines = []
    for key, value in zip(keys, values, strict=True):
        parts = [f"{key}={value}"] + [f"{rng.choice(NOISE)}={rng.randint(0, 9)}" for _ in range(distractors)]
        rng.shuffle(parts)
        lines.append(" ".join(parts))
    asked = rng.randrange(min(asked_from, facts))
    return lines, keys[asked], values[asked]


def refill_kept(prompt: str, refill: str, key: str, value: int) -> bool | None:
    """Whether a Memory Diffusion refill kept the fact the question asks, `key=value`: its prompt is
    the task, "[[", the chunk, "]]" (then, with `memory.refill_context`, what follows the chunk) and
    "N:"; None when the chunk did not hold the fact whole (a span may cut it)."""
    start = prompt.find("[[") + 2
    chunk = prompt[start : prompt.find("]]", start)]
    fact = f"{key}={value}"
    return None if fact not in chunk else fact in refill


def episodes(tokenizer, episode: Callable[[random.Random], tuple[list[str], str, int]], name: str = "ledger"):
    """`SeededDataset`'s name and draw for ledger-shaped episodes: `episode(rng)` gives one episode's
    lines, the key asked and its value (`ledger`, or another shape on the same turns:
    `trillora.envs.registers`), a `LedgerGroup` of them per group."""
    return name, lambda rng, split, size: LedgerGroup(*episode(rng), tokenizer, size)


class LedgerGroup(EnvGroupBuilder):
    def __init__(self, lines: list[str], key: str, value: int, tokenizer, group_size: int):
        self.lines, self.key, self.value, self.tokenizer, self.group_size = lines, key, value, tokenizer, group_size

    def make_envs(self) -> list[Env]:
        return [LedgerEnv(self.lines, self.key, self.value, self.tokenizer) for _ in range(self.group_size)]


def dataset(
    tokenizer,
    batch_size: int,
    group_size: int,
    eval_size: int,
    seed: int,
    facts: int = 6,
    distractors: int = 3,
    asked_from: int = 2,
) -> SeededDataset:
    if facts < 1 or facts > len(KEYS) or distractors < 0 or asked_from < 1:
        raise ValueError(
            f"ledger needs 1 <= facts <= {len(KEYS)}, distractors >= 0 and asked_from >= 1; got "
            f"facts={facts}, distractors={distractors}, asked_from={asked_from}"
        )
    draw = episodes(tokenizer, lambda rng: ledger(rng, facts, distractors, asked_from))
    return SeededDataset(*draw, batch_size, group_size, eval_size, seed)
