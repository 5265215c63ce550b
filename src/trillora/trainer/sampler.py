"""One step's rollouts: env groups → episodes through the engine → rewards (→ dynamic sampling)
→ a `RolloutBatch` of training rows.

Every task runs as envs (`trillora.envs.task_env`: a single-turn task is a one-turn env), so
the same path carries multi-turn envs. Runs on the rank that holds the engine. Rewards are user
code and go through the task's guard (time limit, failure policy). With `rollout.asynchronous` a
thread samples ahead (`trillora.rollout.async_worker`): single-turn batches this module then scores,
or a user env dataset's whole episodes. Shape legend: P groups (prompts) per step, G group size, B rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .. import rl
from ..context import (
    MemoryContext,
    MemoryDiffusion,
    Recall,
    Summarize,
    Truncate,
    attention_mass,
    policy_scores,
    recency,
    surprise,
    word_cuts,
)
from ..envs.env import Trajectory, TrajectoryGroup, Transition
from ..envs.env_dataset import EnvDataset
from ..envs.task_env import TaskGroupBuilder
from ..envs.trajectory import merge_trajectory
from ..errors import ConfigError
from ..policy.logprobs import next_token_logprobs
from ..rollout import Completion, SamplingParams
from ..rollout.async_worker import RolloutWorker
from ..tasks import Problem, Task
from ..tasks.guard import GuardedReward
from ..tasks.prompts import decode_completion, encode_problem, stop_tokens
from .batch import TokenBatch, batch_from_samples, with_routes
from .episodes import EpisodeLimits, episode_metrics, run_groups
from .flops import ModelFlops, rollout_flops


@dataclass
class RolloutBatch:
    """What one step trains on, and what the sampling saw."""

    tokens: TokenBatch
    rewards: torch.Tensor  # [P, G] each trajectory's return
    trajectory_of: torch.Tensor  # [B] the flat trajectory (p·G + g) each row comes from
    groups: list[TrajectoryGroup]  # P
    stats: dict[str, float] = field(default_factory=dict)  # logged with the step
    row_lengths: list[int] = field(default_factory=list)  # [B] tokens of each row, padding left out


@dataclass(frozen=True)
class Request:
    """Sampling round k of a step: the problems, their prompt tokens, n and sampling parameters."""

    problems: list[Problem]
    prompts: list[list[int]]
    n: int
    params: SamplingParams


def rollout_params(r, stop: tuple[int, ...], seed: int | None = None) -> SamplingParams:
    """An engine call's settings for this run's rollouts (`r`: the rollout section; `stop`: the end tokens)."""
    same = ("max_new_tokens", "temperature", "top_p", "top_k")
    return SamplingParams(**{k: getattr(r, k) for k in same}, stop_token_ids=stop, seed=seed)


class Sampler:
    def __init__(
        self,
        cfg,
        engine,
        tokenizer,
        task: Task | None,
        reward: GuardedReward | None,
        device: torch.device,
        routing: bool,
        envs: EnvDataset | None = None,
        flops: ModelFlops | None = None,
    ):
        """Samples `task`'s problems as one-turn envs, or the groups of `envs` (user envs, several turns);
        with `flops`, every engine call of a step is counted (`flops_rollout`)."""
        self.flops = flops
        self.rollout, self.algorithm, self.seed = cfg.rollout, cfg.algorithm, cfg.seed
        self.engine, self.tokenizer, self.task, self.reward, self.envs = engine, tokenizer, task, reward, envs
        self.device, self.routing = device, routing
        self.pad_id = tokenizer.pad_token_id or 0
        r = self.rollout
        stop = stop_tokens(tokenizer, chat=task is not None and task.chat)
        self.params = rollout_params(r, stop)
        self.worker: RolloutWorker | None = None
        """The rollout thread while a run samples ahead (`start_worker`)."""
        self.limits = EpisodeLimits(
            max_turns=cfg.task.max_turns if envs is not None else 1,
            max_model_len=r.max_model_len,
            env_timeout=cfg.task.reward_timeout,
            on_error=cfg.task.on_reward_error,
            memory=memory_factory(cfg.memory, engine, tokenizer, flops) if envs is not None else None,
        )

    def request(self, step: int, k: int = 0) -> Request:
        """The problems of a step's sampling round k: functions of the seed and the step only, so the
        step is their state (a resumed run draws the same prompts)."""
        r = self.rollout
        seed = self.seed * 1_000_003 + step if k == 0 else -((self.seed * 1_000_003 + step) * 16 + k)
        problems = self.task.problems("train", r.prompts_per_step, seed=seed)
        params = dataclasses.replace(self.params, seed=seed, return_routing=self.routing)
        return Request(problems, [encode_problem(self.tokenizer, p) for p in problems], r.group_size, params)

    def start_worker(self, first_step: int, last_step: int) -> RolloutWorker:
        r = self.rollout

        def ask(step: int):
            if self.envs is not None:  # the step's episodes, run on the worker's thread
                builders, params = list(self.envs.get_batch(step)), self._env_params(step)
                return None, lambda engine: run_groups(engine, builders, params, self.limits), None, None
            req = self.request(step)
            return req, req.prompts, req.n, req.params

        self.worker = RolloutWorker(self.engine, ask, first_step, last_step, r.max_staleness)
        return self.worker

    def sample(self, step: int) -> RolloutBatch:
        r, a = self.rollout, self.algorithm
        rounds = []  # (groups, rewards [P, G]) of each sampling round
        staleness = None
        for k in range(a.max_sampling_rounds if a.dynamic_sampling else 1):
            if self.worker is not None:  # sampled ahead by the rollout thread
                sampled = self.worker.take(step)
                groups = (
                    sampled.groups if self.envs is not None else self._scored(sampled.request.problems, sampled.groups)
                )
                staleness = step - sampled.revision
            elif self.envs is not None:  # the dataset's groups of the step (one round: no dynamic sampling)
                groups = run_groups(self.engine, list(self.envs.get_batch(step)), self._env_params(step), self.limits)
            else:
                req = self.request(step, k)
                builders = [
                    TaskGroupBuilder(self.task, p, self.tokenizer, req.n, self.reward, ids)
                    for p, ids in zip(req.problems, req.prompts, strict=True)
                ]
                groups = run_groups(self.engine, builders, req.params, self.limits)
            rewards = torch.tensor([g.total_rewards() for g in groups])  # [P, G]
            rounds.append((groups, rewards))
            if sum(int(rl.informative_groups(x[1]).sum()) for x in rounds) >= r.prompts_per_step:
                break
        sampled = torch.cat([x[1] for x in rounds])
        stats = {
            "reward_mean": float(sampled.mean()),
            "groups_all_equal": float((~rl.informative_groups(sampled)).float().mean()),
        }
        if staleness is not None:  # every sample of the batch came from the same adapter revision
            stats["staleness"] = float(staleness)
        if a.dynamic_sampling:  # the batch: informative groups first in sampling order, padded if short
            chosen, padded = rl.fill_batch([x[1] for x in rounds], r.prompts_per_step)
            groups = [rounds[k][0][i] for k, i in chosen]
            rewards = torch.stack([rounds[k][1][i] for k, i in chosen])
            uninformative = int((~rl.informative_groups(sampled)).sum())
            stats.update(
                sampling_rounds=float(len(rounds)),
                groups_dropped=float(uninformative - padded),
                groups_padded=float(padded),
            )
        if self.envs is not None:
            stats.update(episode_metrics(groups))
        if self.flops is not None:  # every round sampled, the groups dynamic sampling dropped too
            stats["flops_rollout"] = sum(rollout_flops(self.flops, x[0]) for x in rounds)
        return self._batch(groups, rewards, stats)

    def _env_params(self, step: int) -> SamplingParams:
        return dataclasses.replace(self.params, seed=self.seed * 1_000_003 + step, return_routing=self.routing)

    def _scored(self, problems: list[Problem], completions: list[list[Completion]]) -> list[TrajectoryGroup]:
        """Completions sampled ahead as one-turn trajectories, scored on this (the main) thread."""
        groups = []
        for p, group in zip(problems, completions, strict=True):
            trajectories = [
                Trajectory(
                    [
                        Transition(
                            c.prompt_ids,
                            c.token_ids,
                            c.logprobs,
                            self.reward(p, decode_completion(self.tokenizer, c.token_ids)),
                            True,
                            routed_experts=c.routed_experts,
                        )
                    ],
                    [],
                )
                for c in group
            ]
            groups.append(TrajectoryGroup(trajectories, [0.0] * len(group), [{} for _ in group]))
        return groups

    def _batch(self, groups: list[TrajectoryGroup], rewards: torch.Tensor, stats: dict) -> RolloutBatch:
        """Training rows: every trajectory's merged sequences, in group order."""
        samples, trajectory_of, routes = [], [], []
        flat = [t for g in groups for t in g.trajectories]
        for j, t in enumerate(flat):
            for s in merge_trajectory(t):
                samples.append(s)
                trajectory_of.append(j)
            routes += [x.routed_experts for x in t.transitions]
        stats["completion_len_mean"] = sum(len(x.action) for t in flat for x in t.transitions) / len(flat)
        tokens = batch_from_samples(samples, self.pad_id, self.device)
        # one row per trajectory and one first observation per group: rows come in groups sharing a prompt
        one_prompt = all(
            len({tuple(t.transitions[0].observation) if t.transitions else () for t in g.trajectories}) == 1
            for g in groups
        )
        if len(samples) == len(flat) and one_prompt and len({len(g.trajectories) for g in groups}) == 1:
            tokens.group_size = len(groups[0].trajectories)
        if self.routing:
            if len(routes) != len(samples) or any(x is None for x in routes):
                raise ValueError(
                    "router replay needs one routed turn per training row (single-turn samples from an "
                    "engine that returns routing)"
                )
            tokens = with_routes(tokens, routes)
        return RolloutBatch(
            tokens,
            rewards,
            torch.tensor(trajectory_of, device=self.device),
            groups,
            stats,
            [len(s.tokens) for s in samples],
        )


def memory_factory(m, engine, tokenizer, flops: ModelFlops | None = None):
    """A fresh `MemoryContext` per episode as the `memory` section says (None: no memory). Refills
    sample with the episode's settings, seeded per episode and refill; with `flops`, the forwards
    that score chunks are counted."""
    if m.policy == "none":
        return None

    def make(params, index: int) -> MemoryContext:
        seeded = params if params.seed is None else dataclasses.replace(params, seed=params.seed * 131 + index)
        if m.policy == "truncate":
            policy = Truncate()
        elif m.policy == "retrieval":
            policy = Recall(tokenizer)
        elif m.policy == "summary":
            policy = Summarize(engine, tokenizer, seeded, m.summary_tokens)
        else:
            model = getattr(engine, "model", None)
            device = next(model.parameters()).device if model is not None else "cpu"
            if m.importance != "recency" and model is None:
                raise ConfigError(
                    f"memory.importance={m.importance!r} scores chunks with the policy whole in this process: "
                    "use rollout.engine='local' in one process, or memory.importance='recency'"
                )
            importance = {
                "policy": lambda: policy_scores(next_token_logprobs(model), tokenizer.pad_token_id or 0, device),
                "attention": lambda: attention_mass(model),
                "surprise": lambda: surprise(next_token_logprobs(model), device),
                "recency": lambda: recency,
            }[m.importance]()
            policy = MemoryDiffusion(
                engine,
                tokenizer,
                seeded,
                importance,
                m.allocate,
                m.keep_recent,
                m.floor,
                forward_flops=flops.forward if flops is not None else None,
                min_refill=m.min_refill,
                refill_context=m.refill_context,
            )
        cuts = word_cuts(tokenizer) if m.span_words else None
        return MemoryContext(policy, m.budget, params.max_new_tokens, m.span_tokens, cuts)

    return make
