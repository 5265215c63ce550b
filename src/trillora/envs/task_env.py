"""Every single-turn task as an env: the prompt is the observation, one completion the action,
the task's reward the step's reward. The built-in tasks and JSONL datasets run on the env path
unchanged this way."""

from __future__ import annotations

from collections.abc import Callable

from ..tasks.base import Problem, Task
from ..tasks.prompts import decode_completion, encode_problem, stop_tokens
from .env import Env, EnvGroupBuilder, StepResult


class TaskEnv(Env):
    limits_itself = True
    """Its calls need no time limit of the episode runner's: the observation is our own encoding,
    and the reward a guarded one (its own limit and failure policy) when the trainer passes it."""

    def __init__(
        self,
        task: Task,
        problem: Problem,
        tokenizer,
        score: Callable[[Problem, str], float] | None = None,
        observation: tuple[list[int], list[int]] | None = None,
    ):
        """`score(problem, text)`: the reward (default `task.reward`; the trainer passes its guarded one);
        `observation`: the problem already encoded (a group's envs share one encoding)."""
        self.task, self.problem, self.tokenizer = task, problem, tokenizer
        self.score = score or task.reward
        self.observation = observation or observation_of(tokenizer, problem)

    def initial_observation(self) -> tuple[list[int], list[int]]:
        return list(self.observation[0]), list(self.observation[1])

    def step(self, action: list[int]) -> StepResult:
        reward = self.score(self.problem, decode_completion(self.tokenizer, action))
        return StepResult(reward=float(reward), episode_done=True, next_observation=[], next_stop_condition=[])


def observation_of(tokenizer, problem: Problem, ids: list[int] | None = None) -> tuple[list[int], list[int]]:
    """The prompt's ids (`ids` when the caller encoded it already) and what stops its completion."""
    ids = encode_problem(tokenizer, problem) if ids is None else ids
    return ids, list(stop_tokens(tokenizer, chat=problem.messages is not None))


class TaskGroupBuilder(EnvGroupBuilder):
    """`group_size` envs of one problem: a GRPO group."""

    def __init__(
        self,
        task: Task,
        problem: Problem,
        tokenizer,
        group_size: int,
        score: Callable[[Problem, str], float] | None = None,
        prompt_ids: list[int] | None = None,
    ):
        """`prompt_ids`: the problem already encoded (the trainer's sampling request holds it)."""
        self.task, self.problem, self.tokenizer, self.group_size, self.score = (
            task,
            problem,
            tokenizer,
            group_size,
            score,
        )
        self.prompt_ids = prompt_ids

    def make_envs(self) -> list[Env]:
        observation = observation_of(self.tokenizer, self.problem, self.prompt_ids)  # encoded once for the group
        return [
            TaskEnv(self.task, self.problem, self.tokenizer, self.score, observation) for _ in range(self.group_size)
        ]

    def logging_tags(self) -> list[str]:
        return [self.task.name]
