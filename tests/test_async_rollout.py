"""Asynchronous rollouts with the local engine: staleness never above its bound, and with bound 0
the thread reproduces the synchronous run bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SMALL_RUN
from safetensors.torch import load_file

from trillora.config import ConfigError, load_config
from trillora.trainer import Trainer

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
        Trainer(
            load_config(None, [f"out_dir={tmp_path}", "rollout.asynchronous=true", "algorithm.dynamic_sampling=true"])
        )


def test_a_batch_sampled_right_after_a_sync_reports_the_revision_it_used():
    """The race the revision count once lost: a sync lets go of the engine, the thread samples, and
    only then does the count go up, so that batch is reported one update staler than it was. The
    test holds the worker's condition (the count's other lock) across a sync and lets the thread
    sample meanwhile; each batch's reported revision must equal the updates the engine's weights
    really held when it sampled (the real local engine and worker)."""
    import threading

    from trillora.checkpoint import load_model, resolve_model_path
    from trillora.rollout import LocalEngine, SamplingParams
    from trillora.rollout.async_worker import RolloutWorker

    engine = LocalEngine(load_model(resolve_model_path("tiny-moe")), precision="fp32")
    applied, used = [0], {}
    go, synced, sampled = threading.Event(), threading.Event(), threading.Event()

    def request(step):
        if step == 0:
            go.wait(timeout=30)  # outside the engine's lock, as the worker asks for a step

        def job(eng):
            used[step] = applied[0]  # the updates in the weights this batch is sampled from
            sampled.set()
            return eng.generate([[1, 5, 6]], 1, SamplingParams(max_new_tokens=2, temperature=1.0, seed=step))

        return step, job, None, None

    def sync():
        applied[0] += 1  # an update lands in the engine's weights
        synced.set()
        return {}

    worker = RolloutWorker(engine, request, first_step=0, last_step=3, staleness=2)
    with worker.changed:
        syncing = threading.Thread(target=worker.synced, args=(sync,))
        syncing.start()
        assert synced.wait(timeout=30)
        go.set()  # the thread may sample now: before the count went up, unless the sync still holds the engine
        sampled.wait(timeout=1.0)
    syncing.join(timeout=30)
    batches = [worker.take(s) for s in range(3)]
    worker.close()
    assert [b.revision for b in batches] == [used[s] for s in range(3)] == [1, 1, 1]
