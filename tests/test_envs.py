"""The env API and trajectories into training: the merge rule and masks on hand-built trajectories,
episodes of many envs advancing one engine call per turn, the engine's own logprobs kept per token
(checked against the trainer's recomputation), and the bad-input cases of user envs."""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import build_batch

from trillora import lora, rl
from trillora.checkpoint import load_model, load_tokenizer
from trillora.envs.env import Env, EnvGroupBuilder, StepResult, Trajectory, Transition
from trillora.envs.task_env import TaskGroupBuilder
from trillora.envs.trajectory import Sample, merge_trajectory
from trillora.policy.logprobs import shared_prompt_logprobs, token_logprobs
from trillora.rollout import LocalEngine, SamplingParams
from trillora.tasks import ArithmeticTask
from trillora.trainer.batch import batch_from_samples, completion_spans
from trillora.trainer.episodes import (
    EnvError,
    EpisodeLimits,
    episode_metrics,
    run_episodes,
    run_groups,
)


def training_samples(groups, advantage: str, normalize_std: bool) -> tuple[list[Sample], list[float]]:
    """Every trajectory's merged sequences, each with its trajectory's group-relative advantage."""
    samples, advantages = [], []
    for g in groups:
        adv_G = rl.group_advantages(torch.tensor([g.total_rewards()]), advantage, normalize_std)[0]  # [G]
        for t, a in zip(g.trajectories, adv_G.tolist(), strict=True):
            for s in merge_trajectory(t):
                samples.append(s)
                advantages.append(a)
    return samples, advantages


def test_merge_keeps_one_sequence_while_the_prefix_property_holds():
    t = [
        Transition([1, 2], [3, 4], [-0.1, -0.2], 0.0, False),
        Transition([1, 2, 3, 4, 5], [6], [-0.3], 0.0, False),  # extends: observation token 5 (mask 0), action 6
        Transition([9, 5, 6], [7, 8], [-0.4, -0.5], 1.0, True),
    ]  # history rewritten: a new sequence
    first, second = merge_trajectory(Trajectory(t, []))
    assert first == Sample([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1], [0.0, 0.0, -0.1, -0.2, 0.0, -0.3], 2)
    assert second == Sample([9, 5, 6, 7, 8], [0, 0, 0, 1, 1], [0.0, 0.0, 0.0, -0.4, -0.5], 3)
    batch = batch_from_samples([first, second], pad_id=0)
    # position j predicts token j+1: trained targets sit one to the left of the trained tokens
    assert batch.completion_mask.tolist() == [[0, 1, 1, 0, 1], [0, 0, 1, 1, 0]]
    assert batch.rollout_logprobs[0].tolist() == pytest.approx([0.0, -0.1, -0.2, 0.0, -0.3])
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [9, 5, 6, 7, 8, 0]]
    assert completion_spans(batch, torch.arange(2)).tolist() == [4, 2]  # prompt end to last trained token
    with pytest.raises(ValueError, match="turn 0: 2 action tokens but 1 logprobs"):
        merge_trajectory(Trajectory([Transition([1], [2, 3], [-1.0], 0.0, True)], []))


def test_single_turn_rows_are_the_samples_of_one_turn():
    prompts, completions, logprobs = [[1, 5, 6], [1, 7]], [[8, 9], [4]], [[-0.5, -0.25], [-1.0]]
    a = build_batch(prompts, completions, logprobs)
    b = batch_from_samples(
        [Sample.single_turn(p, c, lp) for p, c, lp in zip(prompts, completions, logprobs, strict=True)]
    )
    for field in ("input_ids", "completion_mask", "rollout_logprobs", "prompt_lengths"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert a.completion_mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]


class Counting(Env):
    """Multi-turn, chat-like: each observation is the history plus a feedback token; done after 3 turns."""

    def __init__(self, start: int, turns: int = 3):
        self.history, self.turns, self.left = [1, start], turns, turns

    def initial_observation(self):
        return list(self.history), []

    def step(self, action):
        self.left -= 1
        self.history += list(action) + [10 + self.left]  # the env's reply, a token the policy does not train on
        return StepResult(
            reward=float(len(action)),
            episode_done=self.left == 0,
            next_observation=list(self.history),
            next_stop_condition=[],
            metrics={"left": float(self.left)},
        )


class Counted:
    """An engine wrapper that records each call's batch size."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, n, params):
        self.calls.append(len(prompts) if n == 1 else (len(prompts), n))
        return self.engine.generate(prompts, n, params)


@pytest.fixture(scope="module")
def tiny():
    model = load_model("tiny-moe")
    lora.apply_lora(model, lora.LoraConfig(rank=4))
    return model, load_tokenizer("tiny-moe")


def test_episodes_advance_together_and_keep_the_engines_logprobs(tiny):
    model, _ = tiny
    engine = Counted(LocalEngine(model, precision="fp32"))
    envs = [Counting(start=20 + i, turns=3 if i < 3 else 2) for i in range(5)]
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=7)
    trajectories = run_episodes(engine, envs, params, EpisodeLimits(max_turns=5))
    assert engine.calls == [5, 5, 3]  # every live episode in one call per turn; two finish after 2 turns
    assert [len(t.transitions) for t in trajectories] == [3, 3, 3, 2, 2]
    assert all(t.stop_reason == "done" for t in trajectories)
    samples = [s for t in trajectories for s in merge_trajectory(t)]
    assert len(samples) == 5  # the prefix property held: one sequence per episode
    batch = batch_from_samples(samples)
    with torch.no_grad():
        trainer_logp = token_logprobs(model, batch.input_ids, 1.0)[0]
    on = batch.completion_mask.bool()
    assert int(on.sum()) == sum(len(tr.action) for t in trajectories for tr in t.transitions)
    assert (trainer_logp - batch.rollout_logprobs)[on].abs().max() < 1e-4  # the engine's tokens and logprobs, per token
    again = run_episodes(
        LocalEngine(model, precision="fp32"), [Counting(20 + i) for i in range(5)], params, EpisodeLimits(max_turns=5)
    )
    assert [t.transitions[0].action for t in again[:3]] == [t.transitions[0].action for t in trajectories[:3]]  # seeded


def test_later_turns_prefill_only_what_they_add(tiny):
    """The local engine keeps each episode's keys and values across turns: the same tokens and
    logprobs as prefilling the whole history again, with the history not prefilled twice."""
    from trillora.envs.guessing import dataset

    model, tok = tiny
    ds = dataset(tok, batch_size=4, group_size=2, eval_size=0, seed=0)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    runs = {}
    for keep in (True, False):
        engine = LocalEngine(model, precision="fp32")
        engine.keep_kv = keep
        groups = run_groups(engine, list(ds.get_batch(0)), params, EpisodeLimits(max_turns=4))
        runs[keep] = ([t for g in groups for t in g.trajectories], engine.reused_tokens)
        assert engine._kept is None  # freed when the episodes end
    (kept, reused), (fresh, none) = runs[True], runs[False]
    assert none == 0 and reused > 100
    assert max(len(t.transitions) for t in kept) > 1
    for a, b in zip(kept, fresh, strict=True):
        assert [x.action for x in a.transitions] == [x.action for x in b.transitions]
        assert [x.observation for x in a.transitions] == [x.observation for x in b.transitions]
        for x, y in zip(a.transitions, b.transitions, strict=True):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4)
    engine = LocalEngine(model, precision="fp32")
    engine.generate([[1, 5, 6]], 1, params)
    engine.sync(model)  # new weights: the kept keys and values are stale
    engine.generate([[1, 5, 6, 7, 8]], 1, params)
    assert engine.reused_tokens == 0


def test_turn_and_context_limits_end_episodes_and_are_counted(tiny):
    model, _ = tiny
    engine = LocalEngine(model, precision="fp32")
    params = SamplingParams(max_new_tokens=4, seed=1)
    capped = run_episodes(engine, [Counting(20, turns=10)], params, EpisodeLimits(max_turns=2))
    assert capped[0].stop_reason == "max_turns" and len(capped[0].transitions) == 2
    # 2 tokens, then at most 4 + 1 per turn: the second turn's observation (<= 7) + 4 passes 10
    short = run_episodes(engine, [Counting(20, turns=10)], params, EpisodeLimits(max_turns=8, max_model_len=10))
    assert short[0].stop_reason == "context" and len(short[0].transitions) == 1
    from trillora.envs.env import TrajectoryGroup

    metrics = episode_metrics([TrajectoryGroup(capped + short, [0.0, 0.0], [{}, {}])])
    assert metrics["episodes_context"] == 1.0 and metrics["episodes_max_turns"] == 1.0 and metrics["turns_mean"] == 1.5


class Raising(Counting):
    def step(self, action):
        raise KeyError("no such tool")


class Hanging(Counting):
    def step(self, action):
        while True:
            pass


def test_an_env_that_raises_or_hangs_fails_naming_it_or_ends_its_episode(tiny):
    model, _ = tiny
    engine = LocalEngine(model, precision="fp32")
    params = SamplingParams(max_new_tokens=2, seed=1)
    with pytest.raises(EnvError, match=r"Raising.step failed at turn 0: KeyError: 'no such tool'"):
        run_episodes(engine, [Counting(20), Raising(21)], params, EpisodeLimits())
    with pytest.raises(EnvError, match=r"Hanging.step failed at turn 0: RewardTimeout"):
        run_episodes(engine, [Hanging(21)], params, EpisodeLimits(env_timeout=0.2))
    out = run_episodes(
        engine, [Counting(20), Raising(21), Hanging(22)], params, EpisodeLimits(env_timeout=0.2, on_error="zero")
    )
    assert [t.stop_reason for t in out] == ["done", "error", "error"]
    assert out[1].transitions[0].reward == 0.0 and out[1].transitions[0].metrics == {"env_error": 1.0}


class AsyncCounting(Counting):
    """The cookbook's envs are `async def`: they run as they are."""

    async def initial_observation(self):
        return Counting.initial_observation(self)

    async def step(self, action):
        return Counting.step(self, action)


class Pairwise(EnvGroupBuilder):
    """A group reward that sees the whole group: +1 to the trajectory with the most tokens."""

    def __init__(self, start):
        self.start = start

    async def make_envs(self):
        return [AsyncCounting(self.start), AsyncCounting(self.start)]

    def compute_group_rewards(self, trajectories):
        sizes = [sum(len(t.action) for t in tr.transitions) for tr in trajectories]
        return [(1.0 if s == max(sizes) else 0.0, {"size": float(s)}) for s in sizes]


def test_groups_of_async_envs_with_a_group_reward(tiny):
    model, _ = tiny
    groups = run_groups(
        LocalEngine(model, precision="fp32"),
        [Pairwise(20), Pairwise(30)],
        SamplingParams(max_new_tokens=3, seed=3),
        EpisodeLimits(),
    )
    assert [len(g.trajectories) for g in groups] == [2, 2]
    for g in groups:
        assert max(g.group_rewards) == 1.0
        assert g.total_rewards() == [t.total_reward + r for t, r in zip(g.trajectories, g.group_rewards, strict=True)]
    samples, advantages = training_samples(groups, "grpo", False)
    assert len(samples) == 4
    expected = [r - sum(g.total_rewards()) / 2 for g in groups for r in g.total_rewards()]  # GRPO without std
    assert advantages == pytest.approx(expected)


def test_every_task_is_a_single_turn_env(tiny):
    model, tokenizer = tiny
    task = ArithmeticTask(digits=2)
    problems = task.problems("train", 3, seed=0)
    engine = Counted(LocalEngine(model, precision="fp32"))
    groups = run_groups(
        engine,
        [TaskGroupBuilder(task, p, tokenizer, 4) for p in problems],
        SamplingParams(max_new_tokens=6, seed=5),
        EpisodeLimits(),
    )
    assert engine.calls == [(3, 4)]  # a group's shared first observation: one prompt, n = 4 (prefilled once)
    for p, g in zip(problems, groups, strict=True):
        assert len(g.trajectories) == 4
        for t in g.trajectories:
            (turn,) = t.transitions
            assert (
                turn.episode_done and tokenizer.eos_token_id not in turn.action[:-1]
            )  # the stop condition ends the turn
            assert turn.reward == task.reward(p, tokenizer.decode(turn.action, skip_special_tokens=True))


def test_guessing_game_by_hand(tiny):
    from trillora.envs.guessing import GuessEnv

    _, tokenizer = tiny
    env = GuessEnv(secret=11, low=1, high=16, tokenizer=tokenizer)
    obs, stop = env.initial_observation()
    assert tokenizer.decode(obs, skip_special_tokens=True) == "guess 1-16:" and stop == [tokenizer.eos_token_id]

    def act(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    first = env.step(act("5"))
    assert (first.reward, first.episode_done) == (0.0, False)
    assert first.next_observation[: len(obs)] == obs  # the game so far, extended: one training sequence
    assert tokenizer.decode(first.next_observation, skip_special_tokens=True) == "guess 1-16:5 higher\n"
    second = env.step(act("x"))
    assert second.metrics["parse_error"] == 1.0
    assert tokenizer.decode(second.next_observation, skip_special_tokens=True).endswith("x ?\n")
    assert env.step(act("13")).next_observation[-7:] == tokenizer(" lower\n", add_special_tokens=False)["input_ids"]
    done = env.step(act("11"))
    assert (done.reward, done.episode_done) == (1.0, True)


ENV_RUN = (
    'task.name="env"',
    "task.max_turns=3",
    "rollout.max_new_tokens=3",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
)


def test_training_on_user_envs_from_a_module(small_config, tmp_path):
    from trillora.trainer import Trainer

    trainer = Trainer(small_config(*ENV_RUN, 'task.options={env = "env_fns:echo", first = 30}', name="echo"))
    rollout = trainer.sampler.sample(0)
    assert (
        rollout.rewards.shape == (2, 2) and rollout.stats["turns_mean"] == 3.0 and rollout.stats["episodes_done"] == 4
    )
    batch = rollout.tokens
    mask = batch.completion_mask
    assert ((mask[:, 1:] - mask[:, :-1]) == 1).sum(-1).tolist() == [3, 3, 3, 3]  # three actions between env replies
    # a group's envs share their first observation: its prompt runs once, replies and actions after it
    assert batch.group_size == 2
    rows = torch.arange(4)
    with torch.no_grad():
        whole = token_logprobs(trainer.model, batch.input_ids, 1.0)[0]
        shared = shared_prompt_logprobs(
            trainer.model, batch.input_ids, batch.prompt_lengths, completion_spans(batch, rows), 2, 1.0
        )[0]
    assert (whole - shared)[mask.bool()].abs().max() < 1e-5
    summary = trainer.run()
    rows = [json.loads(x) for x in (tmp_path / "echo" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and all(r["turns_mean"] == 3.0 and r["optimizer_steps"] == 1.0 for r in rows[1:])
    assert "eval_accuracy" in rows[0] and "eval_accuracy" in rows[-1]


def test_user_envs_sample_ahead_asynchronously(small_config, tmp_path):
    """With rollout.asynchronous the worker thread runs whole episodes one step ahead."""
    from trillora.trainer import Trainer

    cfg = small_config(
        *ENV_RUN,
        'task.options={env = "env_fns:echo", first = 30}',
        "rollout.asynchronous=true",
        "rollout.max_staleness=1",
        "steps=3",
        "eval_every=3",
        name="ahead",
    )
    summary = Trainer(cfg).run()
    rows = [json.loads(x) for x in (tmp_path / "ahead" / "metrics.jsonl").read_text().splitlines()][1:]
    assert summary["steps"] == 3 and [r["staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["turns_mean"] == 3.0 and r["episodes_done"] == 4 for r in rows)


def test_the_guessing_game_trains_from_its_example_config(tmp_path):
    from trillora.config import load_config
    from trillora.trainer import Trainer

    cfg = load_config(
        "examples/guessing.toml",
        [f"out_dir={tmp_path}", "steps=1", "eval_every=1", "task.eval_problems=4", "rollout.prompts_per_step=2"],
    )
    summary = Trainer(cfg).run()
    assert summary["steps"] == 1 and 0.0 <= summary["eval_after"] <= 1.0


@pytest.mark.parametrize(
    "options,message",
    [
        ("{}", "needs task.options.env"),
        ('{env = "env_fns:missing"}', "env dataset 'env_fns:missing' cannot be imported"),
        ('{env = "env_fns:not_a_dataset"}', "returned int, which has no get_batch"),
    ],
)
def test_bad_env_specs_name_the_culprit(small_config, options, message):
    from trillora.errors import ConfigError
    from trillora.trainer import Trainer

    with pytest.raises(ConfigError, match=message):
        Trainer(small_config(*ENV_RUN, f"task.options={options}"))
    with pytest.raises(ConfigError, match="does not combine yet with"):
        small_config(*ENV_RUN, 'task.options={env = "env_fns:echo"}', "algorithm.dynamic_sampling=true")
