"""Scoring a policy on a task's problems through a rollout engine."""

from __future__ import annotations

from .rollout.types import RolloutEngine, SamplingParams
from .tasks.base import Problem, Task


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompts start with BOS when the tokenizer has one (the tiny model is trained that way)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + ids


def decode_completion(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def evaluate(engine: RolloutEngine, tokenizer, task: Task, problems: list[Problem], params: SamplingParams, n: int = 1,
             score=None) -> float:
    """Mean reward over problems × n samples; `score(problem, text)` (default `task.reward`) scores one."""
    score = score or task.reward
    groups = engine.generate([encode_prompt(tokenizer, p.prompt) for p in problems], n, params)
    scores = [score(p, decode_completion(tokenizer, c.token_ids)) for p, g in zip(problems, groups) for c in g]
    return sum(scores) / max(1, len(scores))
