"""Recorded traffic as a training batch: rewarded traces → sequences, advantages, what was left out.

A trace's reward is the mean of its feedback rewards, or, for a trace nobody scored, the learn
config's reward function over its calls (`module:function(calls) -> float`). Advantages need a
baseline that fits logged traffic, where nothing guarantees a GRPO group:

- traces of one batch whose first prompt is the same (the same task asked again) form a group,
  and each gets its reward minus the group's mean (GRPO's baseline, without the std division);
- a trace whose task does not recur in the batch gets its reward minus the running mean reward of
  its tag (`metadata.task`, "" when the client names none), which then moves toward its reward:
  mean ← decay · mean + (1 - decay) · reward. The first trace of a tag sets the mean (advantage 0).

With `learn.gate = "traces"` a share of the traces (`learn.holdout`, by a hash of their key, so
the split never changes) is held out: never trained on, and replayed by the gate instead.

A trace served by a revision more than `max_staleness` revisions before the learner's current one
is dropped and counted; so is one sampled at another temperature than the learner's logprobs use
(its recorded logprobs would not be comparable), one whose reward is not a finite number within
the store's bound, and one longer than a round's token budget (`learn.max_tokens`: a round runs
between served requests, so its size is how long they may wait). A round takes traces, oldest
first, until that budget is spent; the rest wait for the next.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..envs.trajectory import Sample
from ..tasks.base import in_eval_split, load_callable
from .store import TraceStore
from .trajectory import samples_of
from .types import MAX_REWARD, Call


@dataclass
class Experience:
    samples: list[Sample]
    advantages: list[float]  # one per sample: its trace's
    rewards: list[float]  # one per sample: its trace's
    trace_ids: list[tuple[str, str]]  # the traces trained on, (owner, trace id), each once
    dropped: dict[str, int] = field(default_factory=dict)  # traces left out, by reason
    revisions: list[int] = field(default_factory=list)  # per sample: the revision that served its trace's first call
    left_out: list[tuple[str, str]] = field(default_factory=list)  # dropped for good (stale, temperature, reward, size)
    held_out: list[tuple[str, str]] = field(default_factory=list)  # kept for the gate (`learn.holdout`)


def held_out(key: tuple[str, str], share: float) -> bool:
    """Whether the trace (owner, trace id) belongs to the held-out share: the tasks' hashed split, so
    always the same answer."""
    return in_eval_split(f"{key[0]}/{key[1]}", share)


def reward_function(name: str) -> Callable[[list[Call]], float] | None:
    """`module:function`, imported; None for ""."""
    return load_callable(name, "learn.reward") if name else None


class Baselines:
    """The running mean reward per task tag (state kept between batches)."""

    def __init__(self, decay: float):
        self.decay, self.means = decay, {}

    def advantage(self, tag: str, reward: float) -> float:
        mean = self.means.get(tag, reward)
        self.means[tag] = self.decay * mean + (1.0 - self.decay) * reward
        return reward - mean


def advantages(rewards: list[float], tasks: list[tuple], tags: list[str], baselines: Baselines) -> list[float]:
    """Per trace: group-relative where its task recurs in the batch, else against its tag's running mean."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tasks):
        groups.setdefault(t, []).append(i)
    out = [0.0] * len(rewards)
    for members in groups.values():
        if len(members) > 1:
            mean = sum(rewards[i] for i in members) / len(members)
            for i in members:
                out[i] = rewards[i] - mean
        else:
            (i,) = members
            out[i] = baselines.advantage(tags[i], rewards[i])
    return out


def collect(
    store: TraceStore,
    current: int,
    learn,
    temperature: float,
    baselines: Baselines,
    score: Callable[[list[Call]], float] | None,
    vocab_size: int,
    owners: set[str] | None = None,
) -> Experience:
    """The untrained traces with a reward, as training sequences with advantages (a trace holding
    a token id past `vocab_size` was served by another model: left out and counted). `owners`: the
    keys (digests) whose traces may train (None: every key's); each key's traces form their own groups."""
    rewards, tasks, tags, picked, samples_per, served_by, left_out = [], [], [], [], [], [], []
    dropped = dict.fromkeys(
        ("stale", "other_temperature", "bad_reward", "too_long", "other_vocabulary", "other_key"), 0
    )
    tokens, held = 0, []
    for t in store.untrained(rewarded_only=score is None):
        key = (t["owner"], t["trace_id"])
        if owners is not None and t["owner"] not in owners:
            dropped["other_key"] += 1
            left_out.append(key)
            continue
        if learn.gate == "traces" and held_out(key, learn.holdout):
            held.append(key)
            continue
        calls = store.calls(t["trace_id"], owner=t["owner"])
        size = sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
        if size > learn.max_tokens:  # alone over a round's budget: it would stall serving for its whole round
            dropped["too_long"] += 1
            left_out.append(key)
            continue
        if tokens + size > learn.max_tokens:
            break  # the rest waits for the next round
        tokens += size
        if any(t >= vocab_size or t < 0 for c in calls for t in c.prompt_ids + c.completion_ids):
            dropped["other_vocabulary"] += 1
            left_out.append(key)
            continue
        if current - min(c.revision_number for c in calls) > learn.max_staleness:
            dropped["stale"] += 1
            left_out.append(key)
            continue
        if any(c.params.get("temperature") != temperature for c in calls):
            dropped["other_temperature"] += 1
            left_out.append(key)
            continue
        reward = t["mean_reward"] if t["rewards"] else score(calls)
        if isinstance(reward, (int, float)) and not isinstance(reward, bool) and abs(reward) > MAX_REWARD:
            reward = float("nan")  # a reward function's value, bounded as feedback is
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            dropped["bad_reward"] += 1
            left_out.append(key)
            continue
        picked.append(key)
        rewards.append(float(reward))
        tasks.append((t["owner"], tuple(calls[0].prompt_ids)))  # one key's rewards never move another's baseline
        tags.append(f"{t['owner']}:{calls[0].tag}")  # a running mean per key and tag
        samples_per.append(samples_of(calls))
        served_by.append(calls[0].revision_number)
    adv = advantages(rewards, tasks, tags, baselines)
    out = Experience([], [], [], picked, {k: v for k, v in dropped.items() if v}, left_out=left_out, held_out=held)
    for samples, a, r, k in zip(samples_per, adv, rewards, served_by, strict=True):
        out.samples += samples
        out.advantages += [a] * len(samples)
        out.rewards += [r] * len(samples)
        out.revisions += [k] * len(samples)
    return out
