"""The held-out checks a learner runs on each new revision before it is served (`learn.gate`).

Each returns (score, basis) or None when it has nothing to judge yet. Scores are only compared
on the same basis: the traces gate replays the oldest `learn.gate_traces` held-out traces, a set
that grows until it is full, and a revision measured on a larger set starts a new bar.

- `env`: `[task]`'s held-out env episodes, played with the adapter in its slot (basis "env").
- `traces`: recorded traces kept out of training (`learn.holdout`), each replayed from its first
  prompt with the adapter in its slot (seeded, one sample) and scored by `learn.reward` on the
  replayed call. Only the first call is replayed: later calls depended on what the app did with
  the answers, which the learner cannot redo. A reward that is not a finite number counts 0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import torch

from ..errors import ConfigError
from ..rollout import LocalEngine, SamplingParams
from ..tasks.prompts import stop_tokens
from ..traces.types import MAX_REWARD
from .sampler import rollout_params

GATE_SEED = 4242


def make_gate(learner):
    """The check `learner.cfg.learn.gate` names (a callable: () -> (score, basis) | None)."""
    if learner.tokenizer is None:
        raise ConfigError(
            f"learn.gate={learner.cfg.learn.gate!r} samples with the revision: the learner needs the tokenizer"
        )
    engine = LocalEngine.sharing(learner.base.model, learner.pad_id)
    return env_gate(learner, engine) if learner.cfg.learn.gate == "env" else TracesGate(learner, engine)


def env_gate(learner, engine: LocalEngine):
    from ..envs.env_dataset import load_env_dataset
    from .episodes import EpisodeLimits
    from .evaluate import evaluate_envs

    t, r = learner.cfg.task, learner.cfg.rollout
    if t.name != "env":
        raise ConfigError(
            "learn.gate='env' checks each revision on held-out episodes: it needs task.name = \"env\" "
            "and task.options.env naming the env dataset"
        )
    envs = load_env_dataset(
        t.options,
        tokenizer=learner.tokenizer,
        batch_size=1,
        group_size=1,
        eval_size=t.eval_problems,
        seed=learner.cfg.seed,
    )
    params = rollout_params(r, stop_tokens(learner.tokenizer, chat=False), GATE_SEED)
    limits = EpisodeLimits(
        max_turns=t.max_turns,
        max_model_len=learner.base.model.args.max_position_embeddings,
        env_timeout=t.reward_timeout,
    )

    def check() -> tuple[float, str]:
        with learner.base.use(learner.adapter), torch.no_grad():
            engine.forget()
            return evaluate_envs(engine, list(envs.eval_batch()), params, limits), "env"

    return check


class TracesGate:
    def __init__(self, learner, engine: LocalEngine):
        self.learner, self.engine = learner, engine

    def __call__(self) -> tuple[float, str] | None:
        learner = self.learner
        keys = learner.store.held_out(learner.cfg.learn.gate_traces)
        firsts = [calls[0] for o, t in keys if (calls := learner.store.calls(t, owner=o))]
        if not firsts:
            return None
        scores = [self._score(call, completion) for call, completion in zip(firsts, self.replay(firsts), strict=True)]
        basis = hashlib.sha256(repr(sorted(keys)).encode()).hexdigest()[:16]
        return sum(scores) / len(scores), f"traces:{len(firsts)}:{basis}"

    def replay(self, firsts: list) -> list:
        """One seeded completion per recorded first call, with the revision in the slot (one batch
        per kind and length: chat stops at the end of its turn, each at the call's `max_tokens`)."""
        learner, r = self.learner, self.learner.cfg.rollout
        out: list = [None] * len(firsts)
        groups: dict[tuple[bool, int], list[int]] = {}
        for i, c in enumerate(firsts):
            groups.setdefault((c.kind == "chat", int(c.params.get("max_tokens", r.max_new_tokens))), []).append(i)
        with learner.base.use(learner.adapter), torch.no_grad():
            for (chat, max_tokens), idx in groups.items():
                params = SamplingParams(
                    max_new_tokens=max_tokens,
                    temperature=r.temperature,
                    stop_token_ids=stop_tokens(learner.tokenizer, chat=chat),
                    seed=GATE_SEED,
                )
                self.engine.forget()
                for i, (completion,) in zip(
                    idx, self.engine.generate([firsts[i].prompt_ids for i in idx], 1, params), strict=True
                ):
                    out[i] = completion
        return out

    def _score(self, call, completion) -> float:
        replayed = dataclasses.replace(
            call,
            completion_ids=completion.token_ids,
            logprobs=completion.logprobs,
            finish_reason=completion.finish_reason,
            tool_calls=[],
            revision="gate",
        )
        reward = self.learner.score([replayed])
        ok = isinstance(reward, (int, float)) and not isinstance(reward, bool) and math.isfinite(reward)
        return float(reward) if ok and abs(reward) <= MAX_REWARD else 0.0
