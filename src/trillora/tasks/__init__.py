"""Prompt sources and rewards, and the envs every task runs as."""

import inspect

from ..errors import ConfigError
from .arithmetic import ArithmeticTask
from .base import Problem, Task, first_line
from .code import CodeTask
from .countdown import CountdownTask, evaluate
from .jsonl import DatasetError, JsonlTask, load_reward_fn
from .reversal import ReversalTask

TASKS = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "reversal": ReversalTask,
    "jsonl": JsonlTask,
    "code": CodeTask,
}


def make_task(name: str, **options) -> Task:
    if name not in TASKS:
        raise ConfigError(f"task {name!r}; allowed: {', '.join(TASKS)}")
    allowed = [k for k in inspect.signature(TASKS[name]).parameters if not k.startswith("_") and k != "skipped"]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(f"task.options for task {name!r}: unknown key {unknown[0]!r}; allowed: {', '.join(allowed)}")
    return TASKS[name](**options)


__all__ = [
    "TASKS",
    "ArithmeticTask",
    "CodeTask",
    "CountdownTask",
    "DatasetError",
    "JsonlTask",
    "Problem",
    "ReversalTask",
    "Task",
    "evaluate",
    "first_line",
    "load_reward_fn",
    "make_task",
]
