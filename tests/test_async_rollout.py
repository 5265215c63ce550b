"""Asynchronous rollouts with the local engine: staleness never above its bound, and with bound 0
the thread reproduces the synchronous run bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from trillora.config import ConfigError, load_config
from trillora.trainer import Trainer
from conftest import SMALL_RUN

COMMON = [*SMALL_RUN, "steps=5", "eval_every=5"]


def run(tmp_path, name, *overrides):
    Trainer(load_config(None, [f"out_dir={tmp_path}", f"name={name}", *COMMON, *overrides])).run()
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()[1:]]
    return rows, load_file(str(tmp_path / name / "adapter" / "fused" / "adapter_model.safetensors"))


@pytest.mark.parametrize("k", [1, 2])
def test_staleness_is_bounded(tmp_path, k):
    rows, _ = run(tmp_path, f"k{k}", "rollout.asynchronous=true", f"rollout.max_staleness={k}")
    staleness = [r["staleness"] for r in rows]
    assert all(0 <= s <= k for s in staleness) and max(staleness) >= 1, staleness  # sampled ahead, never too far


def test_bound_zero_is_the_synchronous_run(tmp_path):
    sync_rows, sync_adapter = run(tmp_path, "sync")
    rows, adapter = run(tmp_path, "k0", "rollout.asynchronous=true", "rollout.max_staleness=0")
    assert [r["staleness"] for r in rows] == [0.0] * 5
    assert [r["loss"] for r in rows] == [r["loss"] for r in sync_rows]
    assert all(torch.equal(adapter[k], sync_adapter[k]) for k in adapter)


def test_asynchronous_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(ConfigError, match="no algorithm.dynamic_sampling"):
        Trainer(load_config(None, [f"out_dir={tmp_path}", "rollout.asynchronous=true", "algorithm.dynamic_sampling=true"]))
