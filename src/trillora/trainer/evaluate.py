"""Scoring a policy on a task's problems through a rollout engine (held-out accuracy, retention)."""

from __future__ import annotations

from ..checkpoint.hf import SHIPPED_CHECKPOINTS
from ..config import TrainConfig
from ..envs.env import EnvGroupBuilder
from ..rollout.types import RolloutEngine, SamplingParams
from ..tasks import TASKS
from ..tasks.base import Problem, Task
from ..tasks.prompts import decode_completion, encode_problem
from .episodes import run_groups


def evaluate(
    engine: RolloutEngine,
    tokenizer,
    task: Task,
    problems: list[Problem],
    params: SamplingParams,
    n: int = 1,
    score=None,
) -> float:
    """Mean reward over problems × n samples; `score(problem, text)` (default `task.reward`) scores one."""
    score = score or task.reward
    groups = engine.generate([encode_problem(tokenizer, p) for p in problems], n, params)
    scores = [
        score(p, decode_completion(tokenizer, c.token_ids)) for p, g in zip(problems, groups, strict=True) for c in g
    ]
    return sum(scores) / max(1, len(scores))


def evaluate_envs(engine: RolloutEngine, builders: list[EnvGroupBuilder], params: SamplingParams, limits) -> float:
    """Mean return of held-out env groups' episodes (the success rate when an episode scores 0 or 1)."""
    if not builders:
        return 0.0
    returns = [r for g in run_groups(engine, builders, params, limits) for r in g.total_rewards()]
    return sum(returns) / len(returns)


def retention_task(cfg: TrainConfig) -> str:
    """The retention task a run scores ("" for none), `task.retention = "auto"` decided: reversal
    when a shipped tiny model (pretrained on reversal) learns another built-in task."""
    t = cfg.task
    if t.retention != "auto":
        return t.retention
    built_in = t.name in TASKS and t.name not in ("jsonl", "reversal")
    return "reversal" if built_in and cfg.model.path in SHIPPED_CHECKPOINTS else ""
