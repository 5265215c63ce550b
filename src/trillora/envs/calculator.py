"""A calculator tool for products the model cannot work out alone (4-digit × 3-digit): success is
calling `multiply` with the right factors and copying its result as the answer.

    task.name = "env"
    task.options = { env = "trillora.envs.calculator:dataset" }

A chat model's env: the question is a user message, the tool's schema goes in through the chat
template, the calls are parsed in the tokenizer's tool format.
"""

from __future__ import annotations

import random
import re

from ..chat.renderer import ChatRenderer
from ..errors import ConfigError
from ..tasks.base import in_eval_split
from .env import RepeatGroup
from .env_dataset import SeededDataset
from .tools import ToolEnv

_INTEGER = re.compile(r"-?\d+")
EVAL_FRACTION = 0.1


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def factors(rng: random.Random, digits: tuple[int, int]) -> tuple[int, int]:
    return tuple(rng.randint(10 ** (d - 1), 10**d - 1) for d in digits)


def question(a: int, b: int) -> str:
    return f"{a}*{b}="


def answer_score(text: str, product: int) -> float:
    """1 when the answer's first integer is the product."""
    found = _INTEGER.search(text)
    return float(found is not None and int(found.group()) == product)


def draw(rng: random.Random, digits: tuple[int, int], split: str) -> tuple[int, int]:
    """Factors whose question falls in `split` (held-out by a hash of the question, as tasks do)."""
    while True:
        a, b = factors(rng, digits)
        if in_eval_split(question(a, b), EVAL_FRACTION) == (split == "eval"):
            return a, b


def demonstration(a: int, b: int, call: bool) -> list[dict]:
    """A worked conversation: through the tool, or a direct answer (for pretraining)."""
    ask = {"role": "user", "content": question(a, b)}
    if not call:
        return [ask, {"role": "assistant", "content": str(a * b)}]
    return [
        ask,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "name": "multiply", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]


def dataset(
    tokenizer,
    batch_size: int,
    group_size: int,
    eval_size: int,
    seed: int,
    digits: list[int] = (4, 3),
    tool_format: str | None = None,
    max_tool_calls: int = 2,
    tool_timeout: float = 5.0,
) -> SeededDataset:
    """A product of a `digits[0]`-digit and a `digits[1]`-digit number per group, to be asked of the
    `multiply` tool (`tool_format`: the chat template's tool-call format)."""
    if len(digits) != 2 or min(digits) < 1:
        raise ConfigError(f"calculator digits must be two positive counts like [4, 3], got {list(digits)}")
    renderer, sizes = ChatRenderer(tokenizer, tool_format), (int(digits[0]), int(digits[1]))

    def draw_group(rng: random.Random, split: str, size: int) -> RepeatGroup:
        a, b = draw(rng, sizes, split)

        def make() -> ToolEnv:
            asked = [{"role": "user", "content": question(a, b)}]
            return ToolEnv(
                renderer, asked, [multiply], lambda text: answer_score(text, a * b), max_tool_calls, tool_timeout
            )

        return RepeatGroup(make, size, ("calculator",))

    return SeededDataset("calculator", draw_group, batch_size, group_size, eval_size, seed)
