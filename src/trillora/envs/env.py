"""The environment API, after Tinker cookbook's `rl/types.py`, token in / token out, so the envs
people wrote for it port with little change.

An `Env` is one episode of one agent: it gives a first observation (token ids the policy reads)
and a stop condition (token ids that end the policy's turn), then takes each action (the token
ids the policy produced) and answers with a `StepResult`: a reward, whether the episode is done,
and the next observation — the whole context the policy sees next, not a delta. An
`EnvGroupBuilder` makes the envs of one GRPO group (envs of the same problem) and may add a
reward that looks at the whole group's trajectories.

Methods may be plain or `async def` (the cookbook's are async): `resolve` runs either.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Action = list[int]
Observation = list[int]
StopCondition = list[int]
"""Token ids that end the policy's turn (included in the action when sampled)."""
Metrics = dict[str, float]


@dataclass
class StepResult:
    reward: float
    episode_done: bool
    next_observation: Observation
    """The whole context of the next turn: the history so far (usually the last observation and
    action, extended) and what the env adds."""
    next_stop_condition: StopCondition
    metrics: Metrics = field(default_factory=dict)


@dataclass
class Transition:
    """One turn: what the policy saw, what it sampled (with the engine's logprobs), what it got."""

    observation: Observation
    action: Action
    logprobs: list[float]
    reward: float
    episode_done: bool
    metrics: Metrics = field(default_factory=dict)
    routed_experts: Any = field(default=None, repr=False)
    """The engine's routing of this turn's tokens, when asked for (router replay)."""


@dataclass
class Trajectory:
    transitions: list[Transition]
    final_observation: Observation
    stop_reason: str = "done"
    """"done" (the env ended it), "max_turns", "context" (the next turn would overflow the
    engine's context) or "error" (the env raised; scored by the failure policy)."""

    @property
    def total_reward(self) -> float:
        return sum(t.reward for t in self.transitions)


@dataclass
class TrajectoryGroup:
    """The trajectories of one group and the group rewards its builder added to them."""

    trajectories: list[Trajectory]
    group_rewards: list[float]
    metrics: list[Metrics]

    def total_rewards(self) -> list[float]:
        """Each trajectory's return: its per-turn rewards plus its group reward."""
        return [t.total_reward + g for t, g in zip(self.trajectories, self.group_rewards, strict=True)]


class Env:
    """Stateful environment for one episode of one agent; discard after the episode."""

    def initial_observation(self) -> tuple[Observation, StopCondition]:
        raise NotImplementedError

    def step(self, action: Action) -> StepResult:
        raise NotImplementedError


class EnvGroupBuilder:
    """Makes the envs of one group. GRPO centres rewards over the group; `compute_group_rewards`
    sees every trajectory of the group (a pairwise judge, a multi-agent game) and adds to each."""

    def make_envs(self) -> Sequence[Env]:
        raise NotImplementedError

    def compute_group_rewards(self, trajectories: list[Trajectory]) -> list[tuple[float, Metrics]]:
        return [(0.0, {}) for _ in trajectories]

    def logging_tags(self) -> list[str]:
        return []


class RepeatGroup(EnvGroupBuilder):
    """`size` envs made alike (`make()` once for each), logged under `tags`."""

    def __init__(self, make: Callable[[], Env], size: int, tags: tuple[str, ...] = ()):
        self.make, self.size, self.tags = make, size, tags

    def make_envs(self) -> list[Env]:
        return [self.make() for _ in range(self.size)]

    def logging_tags(self) -> list[str]:
        return list(self.tags)


def resolve(value: Any) -> Any:
    """The value of a plain or `async def` env method's call."""
    if not inspect.isawaitable(value):
        return value
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_await(value))
    raise RuntimeError(
        "an async env method was called from inside a running event loop; call the rollout from synchronous code"
    )


async def _await(value):
    return await value
