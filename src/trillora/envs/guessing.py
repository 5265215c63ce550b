"""A multi-turn guessing game: find a secret number; after each wrong guess the env says whether it
is higher or lower. Success (reward 1) is finding it within the turn limit.

    task.name = "env"
    task.options = { env = "trillora.envs.guessing:dataset", low = 1, high = 16 }

Text in, tokens out through the model's own tokenizer: the observation is the whole game so far,
so each turn extends the last (one training sequence per episode).
"""

from __future__ import annotations

import random
import re

from ..tasks.prompts import decode_completion, encode_prompt
from .env import Env, RepeatGroup, StepResult
from .env_dataset import SeededDataset

_NUMBER = re.compile(r"-?\d+")


class GuessEnv(Env):
    def __init__(self, secret: int, low: int, high: int, tokenizer):
        self.secret, self.low, self.high, self.tokenizer = secret, low, high, tokenizer
        eos = tokenizer.eos_token_id
        self.stop = [eos] if eos is not None else []
        self.history: list[int] = []

    def initial_observation(self) -> tuple[list[int], list[int]]:
        self.history = encode_prompt(self.tokenizer, f"guess {self.low}-{self.high}:")
        return list(self.history), self.stop

    def step(self, action: list[int]) -> StepResult:
        text = decode_completion(self.tokenizer, action).split("\n", 1)[0]
        found = _NUMBER.search(text)
        guess = int(found.group()) if found else None
        if guess == self.secret:
            return StepResult(1.0, True, [], [], {"guessed": 1.0})
        reply = "?" if guess is None else "higher" if guess < self.secret else "lower"
        self.history += list(action) + self.tokenizer(f" {reply}\n", add_special_tokens=False)["input_ids"]
        return StepResult(0.0, False, list(self.history), self.stop, {"parse_error": float(guess is None)})


def dataset(
    tokenizer, batch_size: int, group_size: int, eval_size: int, seed: int, low: int = 1, high: int = 16
) -> SeededDataset:
    """A secret in low..high per group (each a group of `group_size` games)."""
    if not low < high:
        raise ValueError(f"guessing game needs low < high, got low={low}, high={high}")

    def draw(rng: random.Random, split: str, size: int) -> RepeatGroup:
        secret = rng.randint(low, high)
        return RepeatGroup(lambda: GuessEnv(secret, low, high, tokenizer), size)

    return SeededDataset("guess", draw, batch_size, group_size, eval_size, seed)
