"""Dynamic sampling: groups with all-equal rewards are dropped and the batch is refilled from
more prompts, up to a bound; what was dropped is reported."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SMALL_RUN

from trillora import rl
from trillora.config import load_config
from trillora.trainer import Trainer


def test_little_signal_is_the_windows_mean_share_of_one_reward_groups_past_a_threshold():
    assert rl.little_signal([1.0, 1.0, 1.0, 1.0]) is None  # fewer steps than the window
    assert rl.little_signal([0.0, 1.0, 1.0, 0.75, 0.5, 1.0]) == pytest.approx((1 + 1 + 0.75 + 0.5 + 1) / 5)  # 0.85
    assert rl.little_signal([0.5, 0.5, 1.0, 1.0, 0.5]) is None  # 0.7 < 0.75
    assert rl.little_signal([0.6, 0.6], window=2, threshold=0.6) == pytest.approx(0.6)
    default_job = [0.31, 0.41, 0.5, 0.53, 0.5]  # its worst steps (runs/default, seed 0): not flagged
    assert rl.little_signal(default_job) is None


def test_fill_batch_takes_informative_groups_in_sampling_order_then_pads():
    first = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    second = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.5]])
    assert rl.informative_groups(first).tolist() == [False, True, False]
    assert rl.fill_batch([first, second], 3) == ([(0, 1), (1, 0), (1, 2)], 0)
    assert rl.fill_batch([first, second], 2) == ([(0, 1), (1, 0)], 0)
    assert rl.fill_batch([first, second], 4) == ([(0, 0), (0, 1), (1, 0), (1, 2)], 1)  # short: one filler group


def test_trainer_drops_uninformative_groups_and_refills(tmp_path):
    common = [f"out_dir={tmp_path}", *SMALL_RUN, "rollout.prompts_per_step=8", "task.eval_problems=8"]
    plain = Trainer(load_config(None, common)).sampler.sample(0)
    rewards = plain.rewards
    assert "groups_dropped" not in plain.stats
    assert not rl.informative_groups(rewards).all()  # the tiny model gets some groups all right or all wrong
    dynamic = Trainer(
        load_config(None, [*common, "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=4"])
    )
    batch = dynamic.sampler.sample(0)
    s, rewards = batch.stats, batch.rewards
    assert batch.tokens.num_rows == len(batch.trajectory_of) == 32 and rewards.shape == (8, 4)
    assert s["groups_dropped"] > 0 and s["sampling_rounds"] >= 2
    assert int((~rl.informative_groups(rewards)).sum()) == s["groups_padded"]
    summary = Trainer(
        load_config(None, [*common, "algorithm.dynamic_sampling=true", "steps=2", "eval_every=2", "name=dyn"])
    ).run()
    rows = [json.loads(x) for x in (tmp_path / "dyn" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and all("groups_dropped" in r and "sampling_rounds" in r for r in rows[1:])
    one_round = Trainer(
        load_config(None, [*common, "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=1"])
    )
    batch = one_round.sampler.sample(0)
    assert batch.stats["groups_padded"] == int((~rl.informative_groups(batch.rewards)).sum()) > 0
