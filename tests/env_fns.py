"""User env code for the tests, imported by `task.options.env = "env_fns:..."` like a user's module."""

from __future__ import annotations

from trillora.envs.env import Env, EnvGroupBuilder, StepResult


class Echo(Env):
    """Three turns; after each action the env appends two reply tokens (trained on by nobody)."""

    def __init__(self, start: int):
        self.history, self.left = [1, start], 3

    async def initial_observation(self):  # async, as Tinker cookbook envs are
        return list(self.history), []

    async def step(self, action):
        self.left -= 1
        self.history += list(action) + [40, 41]
        return StepResult(float(4 in action), self.left == 0, list(self.history), [], {"left": float(self.left)})


class EchoGroup(EnvGroupBuilder):
    def __init__(self, start: int, size: int):
        self.start, self.size = start, size

    def make_envs(self):
        return [Echo(self.start) for _ in range(self.size)]


class EchoDataset:
    def __init__(self, batch_size: int, group_size: int, first: int):
        self.batch_size, self.group_size, self.first = batch_size, group_size, first

    def get_batch(self, index):
        return [EchoGroup(self.first + index + i, self.group_size) for i in range(self.batch_size)]

    def eval_batch(self):
        return [EchoGroup(self.first, 1), EchoGroup(self.first + 1, 1)]


def echo(batch_size: int, group_size: int, first: int = 20) -> EchoDataset:
    """Takes no tokenizer or seed: only the context it names is passed."""
    return EchoDataset(batch_size, group_size, first)


def not_a_dataset(**_):
    return 42
