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
from .env import Env, EnvGroupBuilder, StepResult

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


class GuessGroup(EnvGroupBuilder):
    def __init__(self, secret: int, low: int, high: int, tokenizer, group_size: int):
        self.secret, self.low, self.high, self.tokenizer, self.group_size = secret, low, high, tokenizer, group_size

    def make_envs(self) -> list[Env]:
        return [GuessEnv(self.secret, self.low, self.high, self.tokenizer) for _ in range(self.group_size)]


class GuessDataset:
    """`batch_size` secrets per step (each a group of `group_size` games); `eval_size` fixed held-out ones."""

    def __init__(self, tokenizer, batch_size: int, group_size: int, eval_size: int, seed: int, low: int, high: int):
        if not low < high:
            raise ValueError(f"guessing game needs low < high, got low={low}, high={high}")
        self.tokenizer, self.batch_size, self.group_size, self.seed = tokenizer, batch_size, group_size, seed
        self.low, self.high, self.eval_size = low, high, eval_size

    def get_batch(self, index: int) -> list[GuessGroup]:
        rng = random.Random(f"guess:train:{self.seed}:{index}")
        return [
            GuessGroup(rng.randint(self.low, self.high), self.low, self.high, self.tokenizer, self.group_size)
            for _ in range(self.batch_size)
        ]

    def eval_batch(self) -> list[GuessGroup]:
        rng = random.Random(f"guess:eval:{self.seed}")
        return [
            GuessGroup(rng.randint(self.low, self.high), self.low, self.high, self.tokenizer, 1)
            for _ in range(self.eval_size)
        ]


def dataset(
    tokenizer, batch_size: int, group_size: int, eval_size: int, seed: int, low: int = 1, high: int = 16
) -> GuessDataset:
    return GuessDataset(tokenizer, batch_size, group_size, eval_size, seed, low, high)
