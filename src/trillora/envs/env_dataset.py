"""Envs from user code: `task.name = "env"` and `task.options = {env = "module:function", ...}`.

`function(...)` returns an `EnvDataset`: the groups of envs each step trains on (Tinker cookbook's
`RLDataset.get_batch`) and the held-out groups it is scored on. It is called with the task's other
options, and with whichever of `tokenizer`, `batch_size` (groups per step, `rollout.prompts_per_step`),
`group_size` (`rollout.group_size`), `eval_size` (`task.eval_problems`) and `seed` it accepts.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Sequence

from ..errors import ConfigError
from ..tasks.base import load_callable
from .env import EnvGroupBuilder, resolve


class EnvDataset:
    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        """The groups step `index` trains on (a function of the index, so a resumed run gets the same)."""
        raise NotImplementedError

    def eval_batch(self) -> Sequence[EnvGroupBuilder]:
        """Held-out groups; the mean return of their episodes is the run's `eval_accuracy`."""
        return []


class SeededDataset(EnvDataset):
    """`batch_size` groups of `group_size` per step and `eval_size` fixed held-out groups of one, each
    drawn by `draw(rng, split, size)` from a stream seeded by `name`, the split, `seed` and the step:
    a step draws the same groups whatever ran before it (a resumed run included)."""

    def __init__(self, name: str, draw: Callable, batch_size: int, group_size: int, eval_size: int, seed: int):
        self.name, self.draw, self.seed = name, draw, seed
        self.batch_size, self.group_size, self.eval_size = batch_size, group_size, eval_size

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        rng = random.Random(f"{self.name}:train:{self.seed}:{index}")
        return [self.draw(rng, "train", self.group_size) for _ in range(self.batch_size)]

    def eval_batch(self) -> list[EnvGroupBuilder]:
        rng = random.Random(f"{self.name}:eval:{self.seed}")
        return [self.draw(rng, "eval", 1) for _ in range(self.eval_size)]


def load_env_dataset(options: dict, **context) -> EnvDataset:
    """`options["env"]` names the function; the other options and the `context` it accepts are passed."""
    options = dict(options)
    spec = options.pop("env", None)
    if not isinstance(spec, str):
        raise ConfigError(
            "task.name='env' needs task.options.env = \"module:function\" returning an EnvDataset "
            "(get_batch(index) -> list of EnvGroupBuilder)"
        )
    fn = load_callable(spec, "env dataset")
    try:
        accepted = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        accepted = {}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    given = {k: v for k, v in context.items() if takes_all or k in accepted}
    dataset = resolve(fn(**options, **given))
    if not callable(getattr(dataset, "get_batch", None)):
        raise ConfigError(f"env dataset {spec!r} returned {type(dataset).__name__}, which has no get_batch(index)")
    return dataset
