"""Several episodes of any env one after another in one context: a long-horizon variant of the
calculator, guessing or ledger envs, where the context grows past any budget and what the policy
learned early (the env's rules, earlier answers) must survive whatever memory keeps it.

    task.name = "env"
    task.options = { env = "trillora.envs.marathon:dataset", inner = "trillora.envs.guessing:dataset",
                     episodes = 4, high = 16 }      # the other options go to the inner dataset

Episode k+1's first observation follows episode k's last context (its final action, or the
final context the env showed), without a leading BOS; the return is the sum of the episodes'
rewards. Set `task.max_turns` to cover every episode's turns. An inner group reward
(`compute_group_rewards`) has no meaning across episodes and is refused.
"""

from __future__ import annotations

from ..errors import ConfigError
from .env import Env, EnvGroupBuilder, StepResult, resolve
from .env_dataset import load_env_dataset


class MarathonEnv(Env):
    def __init__(self, envs: list[Env], bos: int | None):
        self.envs, self.bos = envs, bos
        self.k = 0  # the episode running
        self.prefix: list[int] = []  # the context before it started
        self.context: list[int] = []  # the whole context the policy saw last
        self.cut = 0  # leading tokens of the running env's observations left out (its BOS, after the first)

    def initial_observation(self) -> tuple[list[int], list[int]]:
        obs, stop = resolve(self.envs[0].initial_observation())
        self.context = list(obs)
        return list(self.context), stop

    def step(self, action: list[int]) -> StepResult:
        r = resolve(self.envs[self.k].step(action))
        metrics = {**r.metrics, "episodes_done": float(self.k + r.episode_done)}
        if not r.episode_done:
            self.context = self.prefix + list(r.next_observation[self.cut :])
            return StepResult(r.reward, False, list(self.context), r.next_stop_condition, metrics)
        closing = (
            self.prefix + list(r.next_observation[self.cut :]) if r.next_observation else self.context + list(action)
        )
        self.k += 1
        if self.k == len(self.envs):
            return StepResult(r.reward, True, closing, [], metrics)
        obs, stop = resolve(self.envs[self.k].initial_observation())
        self.cut = int(bool(obs) and self.bos is not None and obs[0] == self.bos)
        self.prefix = closing
        self.context = self.prefix + list(obs[self.cut :])
        return StepResult(r.reward, False, list(self.context), stop, metrics)


class MarathonGroup(EnvGroupBuilder):
    """One group: the same `episodes` problems, in the same order, for every member."""

    def __init__(self, builders: list[EnvGroupBuilder], bos: int | None):
        for b in builders:
            if type(b).compute_group_rewards is not EnvGroupBuilder.compute_group_rewards:
                raise ConfigError(
                    f"marathon: {type(b).__name__} adds group rewards, which have no meaning across "
                    f"episodes; use an env without compute_group_rewards"
                )
        self.builders, self.bos = builders, bos

    def make_envs(self) -> list[Env]:
        members = [list(b.make_envs()) for b in self.builders]
        return [MarathonEnv([m[g] for m in members], self.bos) for g in range(len(members[0]))]


class MarathonDataset:
    def __init__(self, inner, episodes: int, bos: int | None):
        self.inner, self.episodes, self.bos = inner, episodes, bos

    def _groups(self, builders) -> list[MarathonGroup]:
        builders = list(builders)
        n = self.episodes
        return [MarathonGroup(builders[i : i + n], self.bos) for i in range(0, len(builders) - n + 1, n)]

    def get_batch(self, index: int) -> list[MarathonGroup]:
        return self._groups(self.inner.get_batch(index))

    def eval_batch(self) -> list[MarathonGroup]:
        return self._groups(self.inner.eval_batch())


def dataset(
    tokenizer,
    batch_size: int,
    group_size: int,
    eval_size: int,
    seed: int,
    inner: str = "",
    episodes: int = 4,
    **inner_options,
) -> MarathonDataset:
    if not inner or episodes < 1:
        raise ConfigError(
            f'marathon needs task.options.inner = "module:function" (an env dataset) and episodes >= 1; '
            f"got inner={inner!r}, episodes={episodes}"
        )
    data = load_env_dataset(
        {"env": inner, **inner_options},
        tokenizer=tokenizer,
        batch_size=batch_size * episodes,
        group_size=group_size,
        eval_size=eval_size * episodes,
        seed=seed,
    )
    return MarathonDataset(data, episodes, tokenizer.bos_token_id)
