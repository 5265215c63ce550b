"""Reward functions are user code: one that raises, hangs or returns a non-number either stops the run
with its traceback and the prompt named, or scores 0 and is counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from trillora.tasks import Problem, Task
from trillora.tasks.guard import GuardedReward, RewardError


class Scripted(Task):
    name = "scripted"

    def __init__(self, behaviour):
        self.behaviour = behaviour

    def sample(self, rng):
        return Problem(prompt="1+1=", answer="2")

    def reward(self, problem, completion):
        return self.behaviour(completion)


def spin(_):
    while True:
        pass


def boom(_):
    raise KeyError("score")


@pytest.mark.parametrize(
    "behaviour,cause",
    [
        (boom, "KeyError: 'score'"),
        (lambda _: float("nan"), "not a finite number"),
        (lambda _: "high", "could not convert"),
        (spin, "no result after 0.2 s"),
        (lambda _: time.sleep(30), "no result after 0.2 s"),
    ],
    ids=["raises", "nan", "not-a-number", "busy-loop", "sleep"],
)
def test_a_bad_reward_fails_with_the_prompt_named_or_scores_zero(behaviour, cause):
    problem = Problem(prompt="12+30=", answer="42")
    with pytest.raises(RewardError, match=r"reward of task 'scripted' (failed|timed out) on prompt '12\+30='") as e:
        GuardedReward(Scripted(behaviour), timeout=0.2)(problem, "42")
    assert cause in str(e.value)
    guard = GuardedReward(Scripted(behaviour), timeout=0.2, on_error="zero")
    assert guard(problem, "42") == 0.0 and guard(problem, "x") == 0.0 and guard.failures == 2
    assert GuardedReward(Scripted(lambda c: 1.0), timeout=0.2)(problem, "42") == 1.0  # the timer was cleared
    time.sleep(0.3)  # no stray alarm left behind


def test_on_reward_error_is_validated():
    with pytest.raises(ValueError, match="allowed: fail, zero"):
        GuardedReward(Scripted(boom), on_error="skip")


@pytest.mark.slow
def test_train_stops_with_the_users_traceback_or_counts_failures(tmp_path):
    (tmp_path / "flaky_reward.py").write_text(
        textwrap.dedent("""
        def score(completion, row):
            if int(row["answer"]) % 3 == 0:
                return row["missing"]  # the user's bug, on some rows only
            return float(completion.strip() == row["answer"])
    """)
    )
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(40) for b in range(40)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = f'task.options={{path = "{tmp_path / "data.jsonl"}", reward_fn = "flaky_reward:score"}}'
    common = [
        "-m",
        "trillora",
        "train",
        f"out_dir={tmp_path}",
        "task.name=jsonl",
        options,
        'task.retention=""',
        "steps=2",
        "eval_every=2",
        "rollout.prompts_per_step=8",
        "rollout.group_size=4",
        "task.eval_problems=8",
    ]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, *common, "name=fail"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2
    assert 'flaky_reward.py", line 4, in score' in out.stderr and "KeyError: 'missing'" in out.stderr
    assert "error: reward of task 'jsonl' failed on prompt '" in out.stderr
    out = subprocess.run(
        [sys.executable, *common, "name=zero", "task.on_reward_error=zero"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((tmp_path / "zero" / "summary.json").read_text())
    metrics = [json.loads(x) for x in (tmp_path / "zero" / "metrics.jsonl").read_text().splitlines()]
    assert summary["reward_failures"] > 0
    assert sum(r.get("reward_failures", 0) for r in metrics) <= summary["reward_failures"]  # the rest: evaluations


def test_only_our_own_rewards_run_without_a_timer():
    """The built-in tasks' rewards are string arithmetic that cannot hang: no timer per call (256 a
    step on the default job); a user's reward (a Task that does not say so) keeps its limit."""

    from trillora.tasks import ArithmeticTask, CountdownTask, JsonlTask, ReversalTask

    assert ArithmeticTask.reward_is_ours and CountdownTask.reward_is_ours and ReversalTask.reward_is_ours
    assert not JsonlTask.reward_is_ours and not Scripted.reward_is_ours
    with pytest.raises(RewardError, match="no result after 0.2 s"):
        GuardedReward(Scripted(lambda c: time.sleep(5)), timeout=0.2)(Problem(prompt="1+1=", answer="2"), "2")
