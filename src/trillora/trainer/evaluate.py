"""Scoring a policy on a task's problems through a rollout engine (held-out accuracy, retention)."""

from __future__ import annotations

from ..rollout.types import RolloutEngine, SamplingParams
from ..tasks.base import Problem, Task
from ..tasks.prompts import decode_completion, encode_prompt


def evaluate(engine: RolloutEngine, tokenizer, task: Task, problems: list[Problem], params: SamplingParams, n: int = 1,
             score=None) -> float:
    """Mean reward over problems × n samples; `score(problem, text)` (default `task.reward`) scores one."""
    score = score or task.reward
    groups = engine.generate([encode_prompt(tokenizer, p.prompt) for p in problems], n, params)
    scores = [score(p, decode_completion(tokenizer, c.token_ids)) for p, g in zip(problems, groups) for c in g]
    return sum(scores) / max(1, len(scores))
