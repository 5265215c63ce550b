"""The memory layer on scripted trajectories: contexts worked out by hand, the budget never
exceeded, training samples split exactly where the memory rewrote the context, and a real engine
running long episodes through it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trillora.config import ConfigError, load_config
from trillora.memory import Chunk, MemoryContext, Truncate, split_spans
from trillora.tasks.env import Env, StepResult, Trajectory, Transition
from trillora.tasks.trajectory import merge_trajectory


def test_truncation_by_hand():
    m = MemoryContext(Truncate(), budget=12, reserve=2)  # the context may hold 10 tokens
    assert m.start([1, 2, 3]) == [1, 2, 3]
    # turn 1: action [4, 5], the env adds [6]: 6 tokens, fits
    assert m.step([4, 5], [1, 2, 3, 4, 5, 6], 1) == [1, 2, 3, 4, 5, 6]
    # turn 2: action [7, 8], the env adds [9]: 9 tokens, fits
    assert m.step([7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9], 2) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert m.rewrites == 0
    # turn 3: action [10], the env adds [11, 12]: 12 > 10, the oldest turn (4, 5, 6) goes; the task stays
    assert m.step([10], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 3) == [1, 2, 3, 7, 8, 9, 10, 11, 12]
    assert (m.rewrites, m.dropped) == (1, 3)
    # turn 4: the env's history goes on from ITS last observation; the policy's context from its own
    assert m.step([13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], 4) == [1, 2, 3, 10, 11, 12, 13, 14]
    assert [c.turn for c in m.chunks] == [0, 3, 4] and (m.rewrites, m.dropped) == (2, 6)
    # an env that rewrites its own history starts the context over
    assert m.step([15], [1, 2, 99], 5) == [1, 2, 99] and [c.turn for c in m.chunks] == [0]


def test_spans_cut_turns_and_drop_finer():
    chunks = [Chunk([1, 2, 3], 0), Chunk([4, 5, 6, 7, 8], 1), Chunk([9, 10], 2)]
    assert split_spans(chunks, 2) == [Chunk([1, 2, 3], 0), Chunk([4, 5], 1), Chunk([6, 7], 1), Chunk([8], 1),
                                      Chunk([9, 10], 2)]
    m = MemoryContext(Truncate(), budget=10, reserve=2, span_tokens=2)
    m.start([1, 2, 3])
    m.step([4, 5], [1, 2, 3, 4, 5, 6, 7, 8], 1)  # 8 tokens: fits
    # 10 > 8: the span [4, 5] goes (by whole turns, all of 4..8 would have gone)
    assert m.step([9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 2) == [1, 2, 3, 6, 7, 8, 9, 10]
    whole = MemoryContext(Truncate(), budget=10, reserve=2)
    whole.start([1, 2, 3])
    whole.step([4, 5], [1, 2, 3, 4, 5, 6, 7, 8], 1)
    assert whole.step([9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 2) == [1, 2, 3, 9, 10]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(0, 6), st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), max_size=20),
       st.integers(0, 4))
def test_the_budget_is_never_exceeded(task, reserve, turns, span):
    budget = task + reserve + 4
    m = MemoryContext(Truncate(), budget, reserve, span)
    env_history = list(range(task))
    context = m.start(env_history)
    for k, (action, added) in enumerate(turns, start=1):
        assert len(context) + reserve <= budget
        env_history = env_history + [100 + k] * action + [200 + k] * added
        context = m.step([100 + k] * action, env_history, k)
        assert context[:task] == list(range(task))  # the task is kept
    assert len(context) + reserve <= budget


def test_samples_split_where_the_memory_rewrote():
    """The policy's turns as training samples: one sequence until the rewrite, a new one after it."""
    m = MemoryContext(Truncate(), budget=12, reserve=2)
    history, transitions, context = [1, 2, 3], [], None
    context = m.start(history)
    for k, (action, added) in enumerate([([4, 5], [6]), ([7, 8], [9]), ([10], [11, 12]), ([13], [])], start=1):
        transitions.append(Transition(context, action, [-0.5] * len(action), 0.0, False))
        history = history + action + added
        context = m.step(action, history, k)
    first, second = merge_trajectory(Trajectory(transitions, context))
    assert first.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] and first.mask == [0, 0, 0, 1, 1, 0, 1, 1, 0, 1]
    assert second.tokens == [1, 2, 3, 7, 8, 9, 10, 11, 12, 13] and second.mask == [0] * 9 + [1]
    assert second.prompt_length == 9


class LongTalk(Env):
    """Many turns, each adding 5 tokens after the action: the whole history outgrows the budget."""

    def __init__(self, turns: int):
        self.history, self.left = [1, 7, 7, 7], turns

    def initial_observation(self):
        return list(self.history), []

    def step(self, action):
        self.left -= 1
        self.history += list(action) + [11, 12, 13, 14, 15]
        return StepResult(1.0, self.left == 0, list(self.history), [])


def test_long_episodes_through_a_real_engine_stay_within_the_budget():
    from trillora.checkpoint import load_model
    from trillora.rollout import LocalEngine, SamplingParams
    from trillora.trainer.episodes import EpisodeLimits, episode_metrics, run_episodes
    from trillora.tasks.env import TrajectoryGroup

    engine = LocalEngine(load_model("tiny-moe"), precision="fp32")
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
    limits = EpisodeLimits(max_turns=12, max_model_len=512, memory=lambda: MemoryContext(Truncate(), 30, 4))
    trajectories = run_episodes(engine, [LongTalk(12), LongTalk(12)], params, limits)
    for t in trajectories:
        assert len(t.transitions) == 12 and t.stop_reason == "done"
        assert max(len(x.observation) for x in t.transitions) + 4 <= 30
        assert all(x.observation[:4] == [1, 7, 7, 7] for x in t.transitions)
        rewrites = sum(x.metrics.get("memory_rewrites", 0) for x in t.transitions)
        assert rewrites >= 3 and len(merge_trajectory(t)) == rewrites + 1
    metrics = episode_metrics([TrajectoryGroup(trajectories, [0.0, 0.0], [{}, {}])])
    assert metrics["env/memory_rewrites"] >= 3 and metrics["env/memory_dropped_tokens"] > 0


def test_config_names_what_is_wrong():
    with pytest.raises(ConfigError, match=r"memory.budget=4: it must be over rollout.max_new_tokens \(6\)"):
        load_config(None, ['task.name="env"', 'memory.policy="truncate"', "memory.budget=4"])
    with pytest.raises(ConfigError, match="memory.policy needs multi-turn episodes"):
        load_config(None, ['memory.policy="truncate"', "memory.budget=64"])
    with pytest.raises(ConfigError, match="memory.policy='keep' is invalid; allowed: none, truncate"):
        load_config(None, ['memory.policy="keep"'])
