"""One step's rollouts: prompts → engine → rewards (→ dynamic sampling) → a `RolloutBatch`.

Runs on the rank that holds the engine. Rewards are user code and go through the task's
guard (time limit, failure policy). With `rollout.asynchronous` a thread samples ahead
(`trillora.rollout.async_worker`) and this module only scores what it produced.
Shape legend: P prompts per step, G group size, B = P·G rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .. import rl
from ..rollout import Completion, SamplingParams
from ..rollout.async_worker import RolloutWorker
from ..tasks import Problem, Task
from ..tasks.guard import GuardedReward
from ..tasks.prompts import decode_completion, encode_prompt
from .batch import TokenBatch, build_batch


@dataclass
class RolloutBatch:
    """What one step trains on, and what the sampling saw."""

    tokens: TokenBatch
    rewards: torch.Tensor  # [P, G]
    completions: list[Completion]  # B, group by group
    stats: dict[str, float] = field(default_factory=dict)  # logged with the step


@dataclass(frozen=True)
class Request:
    """Sampling round k of a step: the problems, their prompt tokens, n and sampling parameters."""

    problems: list[Problem]
    prompts: list[list[int]]
    n: int
    params: SamplingParams


class Sampler:
    def __init__(self, cfg, engine, tokenizer, task: Task, reward: GuardedReward, device: torch.device,
                 routing: bool):
        self.rollout, self.algorithm, self.seed = cfg.rollout, cfg.algorithm, cfg.seed
        self.engine, self.tokenizer, self.task, self.reward = engine, tokenizer, task, reward
        self.device, self.routing = device, routing
        self.pad_id = tokenizer.pad_token_id or 0
        r = self.rollout
        stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
        self.params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                     top_k=r.top_k, stop_token_ids=stop)
        self.worker: RolloutWorker | None = None
        """The rollout thread while a run samples ahead (`start_worker`)."""

    def request(self, step: int, k: int = 0) -> Request:
        """The problems of a step's sampling round k: functions of the seed and the step only, so the
        step is their state (a resumed run draws the same prompts)."""
        r = self.rollout
        seed = self.seed * 1_000_003 + step if k == 0 else -((self.seed * 1_000_003 + step) * 16 + k)
        problems = self.task.problems("train", r.prompts_per_step, seed=seed)
        params = dataclasses.replace(self.params, seed=seed, return_routing=self.routing)
        return Request(problems, [encode_prompt(self.tokenizer, p.prompt) for p in problems], r.group_size, params)

    def start_worker(self, first_step: int, last_step: int) -> RolloutWorker:
        r = self.rollout

        def ask(step: int):
            req = self.request(step)
            return req, req.prompts, req.n, req.params

        self.worker = RolloutWorker(self.engine, ask, first_step, last_step, r.max_staleness)
        return self.worker

    def sample(self, step: int) -> RolloutBatch:
        r, a = self.rollout, self.algorithm
        rounds = []  # (problems, groups, rewards [P, G]) of each sampling round
        staleness = None
        for k in range(a.max_sampling_rounds if a.dynamic_sampling else 1):
            if self.worker is not None:  # sampled ahead by the rollout thread
                sampled = self.worker.take(step)
                problems, groups, staleness = sampled.request.problems, sampled.groups, step - sampled.revision
            else:
                req = self.request(step, k)
                problems, groups = req.problems, self.engine.generate(req.prompts, req.n, req.params)
            rewards = torch.tensor([[self.reward(p, decode_completion(self.tokenizer, c.token_ids)) for c in g]
                                    for p, g in zip(problems, groups)])  # [P, G]
            rounds.append((problems, groups, rewards))
            if sum(int(rl.informative_groups(x[2]).sum()) for x in rounds) >= r.prompts_per_step:
                break
        sampled = torch.cat([x[2] for x in rounds])
        stats = {"reward_mean": float(sampled.mean()),
                 "groups_all_equal": float((~rl.informative_groups(sampled)).float().mean())}
        if staleness is not None:  # every sample of the batch came from the same adapter revision
            stats["staleness"] = float(staleness)
        if a.dynamic_sampling:  # the batch: informative groups first in sampling order, padded if short
            chosen, padded = rl.fill_batch([x[2] for x in rounds], r.prompts_per_step)
            groups = [rounds[k][1][i] for k, i in chosen]
            rewards = torch.stack([rounds[k][2][i] for k, i in chosen])
            uninformative = int((~rl.informative_groups(sampled)).sum())
            stats.update(sampling_rounds=float(len(rounds)), groups_dropped=float(uninformative - padded),
                         groups_padded=float(padded))
        flat = [c for g in groups for c in g]
        stats["completion_len_mean"] = sum(len(c.token_ids) for c in flat) / len(flat)
        tokens = build_batch([c.prompt_ids for c in flat], [c.token_ids for c in flat], [c.logprobs for c in flat],
                             pad_id=self.pad_id, device=self.device,
                             routes=[c.routed_experts for c in flat] if self.routing else None)
        return RolloutBatch(tokens, rewards, flat, stats)
