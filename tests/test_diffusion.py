"""Memory Diffusion's refills batched: one engine call per rewrite, one per turn across the
episodes of a run, each refill cut to its budget; the forwards that score chunks counted in
`flops_rollout`."""

from __future__ import annotations

import pytest
import torch

from trillora.checkpoint import load_model, load_tokenizer
from trillora.context import MemoryContext, MemoryDiffusion, RefillRequest, policy_scores, recency, sample_refills
from trillora.envs.env import Env, StepResult, TrajectoryGroup
from trillora.policy.logprobs import next_token_logprobs
from trillora.rollout import LocalEngine, SamplingParams
from trillora.trainer.episodes import EpisodeLimits, run_episodes
from trillora.trainer.flops import ModelFlops, rollout_flops


@pytest.fixture(scope="module")
def engine():
    return LocalEngine(load_model("tiny-moe"), precision="fp32")


class Recording:
    """The real engine, with the prompts of each `generate` call kept."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, n, params):
        self.calls.append([list(p) for p in prompts])
        return self.engine.generate(prompts, n, params)


class Talk(Env):
    """Each turn adds the action and 6 tokens of its own to a history that soon outgrows the budget."""

    def __init__(self, fill: int, turns: int = 6):
        self.history, self.fill, self.left = [1, 7, 7, 7], fill, turns

    def initial_observation(self):
        return list(self.history), []

    def step(self, action):
        self.left -= 1
        self.history += list(action) + [self.fill] * 6
        return StepResult(1.0, self.left == 0, list(self.history), [])


def test_a_refill_is_what_a_call_capped_at_its_budget_samples(engine):
    """The batched call samples up to the largest budget; each row's first `budget` tokens are the
    ones a call capped at that budget draws with the same seed."""
    a, b = [1, 14, 15, 16, 20, 21], [1, 30, 31, 32]
    params = SamplingParams(max_new_tokens=1, temperature=1.0, seed=11)
    refills = sample_refills(engine, params, [RefillRequest(a, 2), RefillRequest(b, 5)])
    capped = engine.generate([a, b], 1, SamplingParams(max_new_tokens=2, temperature=1.0, seed=11))
    assert refills[0].prompt == a and refills[1].prompt == b
    assert refills[0].tokens == list(capped[0][0].token_ids)[:2] and len(refills[0].tokens) <= 2
    assert refills[1].tokens[:2] == list(capped[1][0].token_ids)[:2] and len(refills[1].tokens) <= 5
    assert len(refills[1].logprobs) == len(refills[1].tokens)
    assert refills[0].logprobs == pytest.approx(list(capped[0][0].logprobs)[:2], abs=1e-5)


def test_the_refills_of_every_episode_at_a_turn_are_one_engine_call(engine):
    tok = load_tokenizer("tiny-moe")
    recording = Recording(engine)
    params = SamplingParams(max_new_tokens=3, temperature=1.0, seed=5)

    def memory(call, i):
        return MemoryContext(MemoryDiffusion(recording, tok, call, recency), 26, call.max_new_tokens)

    envs = [Talk(fill) for fill in (20, 21, 22)]
    trajectories = run_episodes(recording, envs, params, EpisodeLimits(max_turns=6, max_model_len=512, memory=memory))
    marker = tok("\n[[", add_special_tokens=False)["input_ids"]

    def is_refill(prompt):
        return any(prompt[k : k + len(marker)] == marker for k in range(len(prompt)))

    refill_calls = [c for c in recording.calls if any(is_refill(p) for p in c)]
    assert refill_calls and all(all(is_refill(p) for p in c) for c in refill_calls)  # never mixed with turns
    fills = (20, 21, 22)  # each episode's own filler: its chunks hold it 6 times

    def episode_of(prompt):
        return max(fills, key=prompt.count)

    assert max(len({episode_of(p) for p in c}) for c in refill_calls) == 3  # three episodes' refills, one call
    refills = [x for t in trajectories for x in t.transitions if "memory_refill_tokens" in x.metrics]
    assert len(refills) == sum(len(c) for c in refill_calls)
    for t in trajectories:
        assert all(len(x.observation) + 3 <= 26 for x in t.transitions if "memory_refill_tokens" not in x.metrics)


def test_the_scoring_forwards_are_counted_in_flops_rollout(engine):
    tok = load_tokenizer("tiny-moe")
    flops = ModelFlops.of(engine.model)
    params = SamplingParams(max_new_tokens=3, temperature=1.0, seed=5)
    score = policy_scores(next_token_logprobs(engine.model), tok.pad_token_id or 0)
    scored = []

    def counting(chunks, masked):
        scored.append(sum(flops.forward(n) for n in score.rows(chunks, masked)))
        return score(chunks, masked)

    counting.rows = score.rows

    def memory(call, i):
        return MemoryContext(MemoryDiffusion(engine, tok, call, counting, forward_flops=flops.forward), 26, 3)

    (t,) = run_episodes(engine, [Talk(20)], params, EpisodeLimits(max_turns=6, max_model_len=512, memory=memory))
    counted = [x.metrics["memory_scoring_flops"] for x in t.transitions if "memory_scoring_flops" in x.metrics]
    assert scored and counted == pytest.approx(scored)
    group = TrajectoryGroup([t], [0.0], [{}])
    engine_calls = sum(flops.sample(len(x.observation), len(x.action)) for x in t.transitions)
    assert rollout_flops(flops, [group]) == pytest.approx(engine_calls + sum(scored))
    assert sum(scored) > 0 and torch.isfinite(torch.tensor(sum(scored)))
