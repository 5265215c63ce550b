"""Episodes of many envs at once, through one rollout engine.

Every live episode advances one turn per engine call: the engine gets the current observation of
each (token ids, as the env gave them) and samples one action each, in one batch; each env then
steps. An episode ends when its env says so, after `max_turns`, or when its next turn would not
fit the engine's context (`max_model_len`: observation + `max_new_tokens`), which is counted.
Envs are user code: a call that raises or hangs (`env_timeout`) stops the run naming the env and
the turn (`on_error="fail"`), or ends that episode with what it has (`"zero"`), counted.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable

from ..context import MemoryContext, sample_refills
from ..envs.env import Env, EnvGroupBuilder, Trajectory, TrajectoryGroup, Transition, resolve
from ..errors import TrilloraError
from ..rollout.types import RolloutEngine, SamplingParams
from ..tasks.guard import OnRewardError, time_limit


class EnvError(TrilloraError, RuntimeError):
    """An env that raised or hung; the message names the env and the turn, the cause has the traceback."""

    show_cause = True


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 8
    max_model_len: int = 1024
    env_timeout: float = 30.0
    on_error: OnRewardError = "fail"
    memory: Callable[[SamplingParams, int], MemoryContext] | None = None
    """A fresh memory per episode (the call's sampling settings, the episode's index): the context
    the policy sees stays within its budget (`trillora.context`)."""


def _call(env: Env, what: str, turn: int, limits: EpisodeLimits, *args):
    try:  # an env whose calls bound themselves (a task's: a guarded reward) takes no second timer
        with time_limit(0 if getattr(env, "limits_itself", False) else limits.env_timeout):
            return resolve(getattr(env, what)(*args))
    except TrilloraError:  # already says what failed (a guarded reward inside the env)
        raise
    except Exception as e:  # RewardTimeout (a hang) included
        if limits.on_error == "fail":
            raise EnvError(f"{type(env).__name__}.{what} failed at turn {turn}: {type(e).__name__}: {e}") from e
        return e


def run_episodes(
    engine: RolloutEngine,
    envs: list[Env],
    params: SamplingParams,
    limits: EpisodeLimits,
    group_of: list[int] | None = None,
) -> list[Trajectory]:
    """One trajectory per env, in order. Envs of one group (`group_of[i]`, default each its own)
    that see the same observation are sampled as one prompt with n samples, so the engine prefills
    it once (a GRPO group's first turn). `params.seed` seeds the first call as it is and the later
    ones derived from it, so a run is reproducible."""
    n = len(envs)
    group_of = group_of if group_of is not None else list(range(n))
    obs: list[list[int]] = [[] for _ in range(n)]
    stop: list[tuple[int, ...]] = [() for _ in range(n)]
    turns: list[list[Transition]] = [[] for _ in range(n)]
    ended: dict[int, str] = {}
    memory = [limits.memory(params, i) if limits.memory is not None else None for i in range(n)]
    for i, env in enumerate(envs):
        first = _call(env, "initial_observation", 0, limits)
        if isinstance(first, BaseException):
            ended[i] = "error"
            continue
        obs[i], stop[i] = list(first[0]), tuple(first[1])
        if memory[i] is not None:
            obs[i] = memory[i].start(obs[i])
    for turn in range(limits.max_turns):
        going_on: list[int] = []  # episodes whose memory takes the turn's new tokens
        by_stop: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i in range(n):
            if i in ended:
                continue
            if len(obs[i]) + params.max_new_tokens > limits.max_model_len:
                ended[i] = "context"
            else:
                by_stop[stop[i]].append(i)
        if not by_stop:
            break
        for k, (stops, idx) in enumerate(by_stop.items()):
            seed = params.seed if params.seed is None or (turn, k) == (0, 0) else params.seed * 8191 + turn * 127 + k
            call = dataclasses.replace(params, stop_token_ids=stops, seed=seed)
            for i, c in _sample(engine, idx, obs, group_of, call):
                was, routes = (obs[i], list(c.token_ids), list(c.logprobs)), c.routed_experts
                answered = memory[i].intercept(c.token_ids, stops, turn + 1) if memory[i] is not None else None
                if answered is not None:  # a `recall` turn: the memory answers, the env does not see it
                    turns[i].append(Transition(*was, 0.0, False, {"memory_recalls": 1.0}, routes))
                    obs[i] = answered
                    continue
                result = _call(envs[i], "step", turn, limits, list(c.token_ids))
                if isinstance(result, BaseException):
                    turns[i].append(Transition(*was, 0.0, True, {"env_error": 1.0}, routes))
                    ended[i] = "error"
                    continue
                reward, done = float(result.reward), bool(result.episode_done)
                turns[i].append(Transition(*was, reward, done, dict(result.metrics), routes))
                if result.episode_done:
                    ended[i] = "done"
                obs[i], stop[i] = list(result.next_observation), tuple(result.next_stop_condition)
                if memory[i] is not None and not result.episode_done:
                    going_on.append(i)
        if going_on:
            _remember(engine, params, memory, turns, obs, going_on, turn)
    forget = getattr(engine, "forget", None)  # an engine keeping keys and values across turns frees them
    if forget is not None:
        forget()
    return [Trajectory(turns[i], obs[i], ended.get(i, "max_turns")) for i in range(n)]


def _remember(
    engine: RolloutEngine,
    params: SamplingParams,
    memory: list[MemoryContext | None],
    turns: list[list[Transition]],
    obs: list[list[int]],
    going_on: list[int],
    turn: int,
) -> None:
    """The context each episode of `going_on` sees next, through its memory; the refills of all the
    episodes that rewrite theirs at this turn are sampled in one engine call. A rewrite is counted
    on the turn that caused it (`memory_rewrites`, `memory_dropped_tokens`, and the FLOPs of the
    forwards that scored its chunks, `memory_scoring_flops`, which `flops_rollout` includes)."""
    before = {i: (memory[i].rewrites, memory[i].dropped) for i in going_on}
    steps = {i: memory[i].stepping(turns[i][-1].action, obs[i], turn + 1) for i in going_on}
    asked = {}
    for i, step in steps.items():
        try:
            asked[i] = next(step)
        except StopIteration as done:
            obs[i] = done.value
    if asked:
        seed = None if params.seed is None else params.seed * 8191 + turn * 127 + 100
        refills = iter(
            sample_refills(engine, dataclasses.replace(params, seed=seed), [r for i in asked for r in asked[i]])
        )
        for i, requests in asked.items():
            try:
                steps[i].send([next(refills) for _ in requests])
            except StopIteration as done:
                obs[i] = done.value
            else:
                raise RuntimeError("a memory asks for its refills once per turn")
    for i in going_on:
        m, last = memory[i], turns[i][-1]
        rewrites, dropped = before[i]
        if m.rewrites > rewrites:
            last.metrics["memory_rewrites"] = float(m.rewrites - rewrites)
            last.metrics["memory_dropped_tokens"] = float(m.dropped - dropped)
        scoring = m.take_scoring_flops()
        if scoring:
            last.metrics["memory_scoring_flops"] = scoring
        for r in m.take_refills():  # the policy's rewrites of its context: trained like its turns
            turns[i].append(
                Transition(r.prompt, r.tokens, r.logprobs, 0.0, False, {"memory_refill_tokens": float(len(r.tokens))})
            )


def _sample(engine: RolloutEngine, idx: list[int], obs: list[list[int]], group_of: list[int], params: SamplingParams):
    """(env index, completion) for each of `idx`, in one engine call: consecutive envs of one group on
    the same observation form a block; equal blocks go as unique prompts × n samples."""
    blocks: list[list[int]] = []
    for i in idx:
        head = blocks[-1][0] if blocks else None
        if head is not None and group_of[head] == group_of[i] and obs[head] == obs[i]:
            blocks[-1].append(i)
        else:
            blocks.append([i])
    if len({len(b) for b in blocks}) > 1:  # uneven blocks: one sample per env
        blocks = [[i] for i in idx]
    out = engine.generate([obs[b[0]] for b in blocks], len(blocks[0]), params)
    return [(i, c) for b, group in zip(blocks, out, strict=True) for i, c in zip(b, group, strict=True)]


def run_groups(
    engine: RolloutEngine, builders: list[EnvGroupBuilder], params: SamplingParams, limits: EpisodeLimits
) -> list[TrajectoryGroup]:
    """The envs of every group run together (one engine call per turn for all), then each builder
    adds its group rewards."""
    groups = [list(resolve(b.make_envs())) for b in builders]
    group_of = [k for k, g in enumerate(groups) for _ in g]
    trajectories = run_episodes(engine, [e for g in groups for e in g], params, limits, group_of)
    out, start = [], 0
    for builder, envs in zip(builders, groups, strict=True):
        mine = trajectories[start : start + len(envs)]
        start += len(envs)
        extra = resolve(builder.compute_group_rewards(mine))
        out.append(TrajectoryGroup(mine, [float(r) for r, _ in extra], [dict(m) for _, m in extra]))
    return out


def episode_metrics(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """Per step: turns per episode, how episodes ended, and each metric the envs report per turn
    (tool calls, parse errors, ...) as its mean total per episode, `env/<name>`."""
    trajectories = [t for g in groups for t in g.trajectories]
    n = max(len(trajectories), 1)
    turns = sum(1 for t in trajectories for x in t.transitions if "memory_refill_tokens" not in x.metrics)
    out = {"turns_mean": turns / n}
    for reason in ("done", "max_turns", "context", "error"):
        out[f"episodes_{reason}"] = float(sum(t.stop_reason == reason for t in trajectories))
    totals: dict[str, float] = defaultdict(float)
    for t in trajectories:
        for x in t.transitions:
            for key, value in x.metrics.items():
                totals[key] += float(value)
    for g in groups:
        for m in g.metrics:
            for key, value in m.items():
                totals[key] += float(value)
    out.update({f"env/{key}": value / n for key, value in sorted(totals.items())})
    return out
