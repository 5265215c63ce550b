"""Numerical guards: a non-finite loss skips the update (logged, counted), the adapter and the engine
never see it, and K in a row stop the run with a checkpoint of the last good state."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SMALL_RUN
from safetensors.torch import load_file

import trillora.rl
from trillora.config import load_config
from trillora.errors import TrainingDiverged
from trillora.trainer import Trainer
from trillora.trainer.update import PolicyUpdate

COMMON = [*SMALL_RUN, "eval_every=100", "checkpoint.every=1", "checkpoint.keep=20"]


def poison(monkeypatch, bad_steps: set[int]):
    """The policy loss of the given (1-based) steps becomes NaN, as an overflow would make it."""
    calls = {"step": 0}
    real = trillora.rl.policy_loss

    def loss(*args, **kwargs):
        value, metrics = real(*args, **kwargs)
        return (value * float("nan") if calls["step"] in bad_steps else value), metrics

    monkeypatch.setattr(trillora.rl, "policy_loss", loss)
    return calls


def run(tmp_path, monkeypatch, bad_steps, *overrides):
    calls = poison(monkeypatch, bad_steps)
    real_update = PolicyUpdate.__call__

    def update(self, batch):
        calls["step"] += 1
        return real_update(self, batch)

    monkeypatch.setattr(PolicyUpdate, "__call__", update)
    trainer = Trainer(load_config(None, [f"out_dir={tmp_path}", "name=g", *COMMON, *overrides]))
    synced = []
    real_sync = trainer.engine.sync
    trainer.engine.sync = lambda model: (
        synced.append(all(torch.isfinite(p).all() for _, p in trillora.lora.lora_parameters(model))) or real_sync(model)
    )
    return trainer, synced


def params_at(tmp_path, step: int) -> dict:
    f = load_file(str(tmp_path / "g" / "checkpoints" / f"step-{step:06d}" / "rank-0.safetensors"))
    return {k: v for k, v in f.items() if k.startswith("param.")}


def test_a_nonfinite_update_is_skipped_and_counted(tmp_path, monkeypatch):
    trainer, synced = run(tmp_path, monkeypatch, {2, 3}, "steps=4")
    summary = trainer.run()
    rows = [json.loads(x) for x in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped_update", 0.0) for r in rows[1:]] == [0.0, 1.0, 1.0, 0.0]
    assert summary["skipped_updates"] == 2 and all(synced)
    one, three, four = params_at(tmp_path, 1), params_at(tmp_path, 3), params_at(tmp_path, 4)
    assert all(torch.equal(one[k], three[k]) for k in one)  # steps 2 and 3 changed nothing
    assert any(not torch.equal(one[k], four[k]) for k in one)  # step 4 trained again


def test_k_nonfinite_updates_in_a_row_stop_the_run_with_the_last_good_state_saved(tmp_path, monkeypatch):
    trainer, synced = run(tmp_path, monkeypatch, {3, 4, 5, 6}, "steps=10", "optim.max_nonfinite_in_a_row=3")
    with pytest.raises(TrainingDiverged, match=r"the last 3 updates \(to step 5\) had a non-finite loss or gradient"):
        trainer.run()
    assert all(synced)
    two, five = params_at(tmp_path, 2), params_at(tmp_path, 5)
    assert all(torch.equal(two[k], five[k]) for k in two)
    adapter = load_file(str(tmp_path / "g" / "checkpoints" / "step-000005" / "adapter" / "adapter_model.safetensors"))
    assert all(torch.isfinite(t).all() for t in adapter.values())
    assert not (tmp_path / "g" / "checkpoints" / "step-000006").exists()
