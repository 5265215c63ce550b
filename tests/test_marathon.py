"""Episodes of an env back to back in one context (`trillora.envs.marathon`): the context carried
over token for token, the return summed, group rewards refused; and episodes run through the
engine with a memory budget below the marathon's length."""

from __future__ import annotations

import pytest

from trillora.checkpoint import load_tokenizer
from trillora.envs.env import EnvGroupBuilder
from trillora.envs.env_dataset import load_env_dataset
from trillora.envs.ledger import LedgerEnv
from trillora.envs.marathon import MarathonEnv, MarathonGroup
from trillora.errors import ConfigError


def test_two_ledgers_in_one_context_by_hand():
    tok = load_tokenizer("tiny-moe")
    text = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tok.eos_token_id
    env = MarathonEnv([LedgerEnv(["a=3"], "a", 3, tok), LedgerEnv(["b=5"], "b", 5, tok)], tok.bos_token_id)
    first, stop = env.initial_observation()
    assert first[0] == tok.bos_token_id and stop == [eos]
    ok, wrong, right = text("ok") + [eos], text("4") + [eos], text("5") + [eos]
    seen = env.step(ok).next_observation
    assert seen == first + ok + text("\na=3\n")
    seen = env.step(ok).next_observation
    assert seen[-2:] == text("a?")
    r = env.step(wrong)  # the first ledger ends (wrong answer); the second starts in the same context
    assert (r.reward, r.episode_done, r.metrics["episodes_done"]) == (0.0, False, 1.0)
    assert r.next_observation == seen + wrong + first[1:]  # its first observation without the BOS
    after = env.step(ok).next_observation  # the second ledger's history goes on after the first, BOS left out
    assert after == r.next_observation + ok + text("\nb=5\n")
    env.step(ok)
    last = env.step(right)
    assert (last.reward, last.episode_done, last.metrics["episodes_done"]) == (1.0, True, 2.0)


def test_the_dataset_chains_inner_groups_and_refuses_group_rewards():
    tok = load_tokenizer("tiny-moe")
    data = load_env_dataset(
        {
            "env": "trillora.envs.marathon:dataset",
            "inner": "trillora.envs.ledger:dataset",
            "episodes": 3,
            "facts": 2,
            "distractors": 1,
        },
        tokenizer=tok,
        batch_size=2,
        group_size=4,
        eval_size=5,
        seed=0,
    )
    batch = data.get_batch(0)
    assert len(batch) == 2 and all(len(g.make_envs()) == 4 for g in batch)
    assert len(data.eval_batch()) == 5 and len(data.eval_batch()[0].make_envs()) == 1
    envs = batch[0].make_envs()  # every member plays the same three ledgers in the same order
    assert len({tuple(tuple(e.lines) for e in m.envs) for m in envs}) == 1 and len(envs[0].envs) == 3

    class Judged(EnvGroupBuilder):
        def compute_group_rewards(self, trajectories):
            return [(1.0, {}) for _ in trajectories]

    with pytest.raises(ConfigError, match="group rewards"):
        MarathonGroup([Judged()], None)
    with pytest.raises(ConfigError, match="inner"):
        load_env_dataset(
            {"env": "trillora.envs.marathon:dataset"}, tokenizer=tok, batch_size=1, group_size=1, eval_size=1, seed=0
        )


def test_a_marathon_runs_through_the_engine_under_a_context_budget():
    """Four ledgers in one context (~200 tokens) with truncation at 48 tokens: every episode runs
    to its end, the context never passes the budget, and the return counts every ledger."""
    from trillora.checkpoint import load_model
    from trillora.config import MemorySection
    from trillora.rollout import LocalEngine, SamplingParams
    from trillora.trainer.episodes import EpisodeLimits, run_groups
    from trillora.trainer.sampler import memory_factory

    tok = load_tokenizer("tiny-moe")
    engine = LocalEngine(load_model("tiny-moe"), precision="fp32")
    data = load_env_dataset(
        {
            "env": "trillora.envs.marathon:dataset",
            "inner": "trillora.envs.ledger:dataset",
            "episodes": 4,
            "facts": 2,
            "distractors": 1,
        },
        tokenizer=tok,
        batch_size=2,
        group_size=2,
        eval_size=1,
        seed=0,
    )
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0, stop_token_ids=(tok.eos_token_id,))
    limits = EpisodeLimits(
        max_turns=16, max_model_len=512, memory=memory_factory(MemorySection(policy="truncate", budget=48), engine, tok)
    )
    groups = run_groups(engine, list(data.get_batch(0)), params, limits)
    for t in (t for g in groups for t in g.trajectories):
        turns = [x for x in t.transitions if "episodes_done" in x.metrics]  # the policy's turns (not refills)
        assert len(turns) == 16 and turns[-1].metrics["episodes_done"] == 4.0 and t.stop_reason == "done"
        assert max(len(x.observation) + len(x.action) for x in t.transitions) <= 48
        assert sum(x.metrics.get("memory_dropped_tokens", 0) for x in t.transitions) > 100  # truncation did the work
        assert t.total_reward == sum(x.reward for x in t.transitions)
