"""Metrics beside metrics.jsonl: TensorBoard event files and an offline W&B run hold the same
numbers per step as the JSONL record (read back with each tool's own reader)."""

from __future__ import annotations

import json
import os
import re

import pytest
from conftest import SMALL_RUN

from trillora.config import ConfigError, load_config
from trillora.trainer import Trainer


def test_tensorboard_and_offline_wandb_get_every_step(tmp_path, monkeypatch):
    if os.environ.get("TRILLORA_REQUIRE_BENCH") != "1":  # make test installs the tracking extra: missing, it fails
        pytest.importorskip("tensorboard")
        pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # offline: nothing leaves the machine
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(
        None,
        [
            f"out_dir={tmp_path}",
            "name=tracked",
            *SMALL_RUN,
            "steps=3",
            "eval_every=3",
            'logging.backends=["tensorboard", "wandb"]',
        ],
    )
    Trainer(cfg).run()
    run = tmp_path / "tracked"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    reward = [(e.step, e.value) for e in events.Scalars("reward_mean")]
    assert reward == [(r["step"], pytest.approx(r["reward_mean"])) for r in rows[1:]]
    accuracy = [(e.step, e.value) for e in events.Scalars("eval_accuracy")]
    assert accuracy == [(0, pytest.approx(rows[0]["eval_accuracy"])), (3, pytest.approx(rows[-1]["eval_accuracy"]))]

    (offline,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    history = {h["_step"]: h for h in wandb_history(offline)}
    assert sorted(history) == [0, 1, 2, 3]
    assert [history[r["step"]]["reward_mean"] for r in rows[1:]] == [pytest.approx(r["reward_mean"]) for r in rows[1:]]
    assert history[0]["eval_accuracy"] == pytest.approx(rows[0]["eval_accuracy"])
    assert history[3]["eval_accuracy"] == pytest.approx(rows[-1]["eval_accuracy"])
    assert not os.environ.get("WANDB_API_KEY")


@pytest.mark.slow
def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    """Resume writes under the same W&B run id (W&B joins the two offline folders into one run),
    from the step after the checkpoint; a fresh run gets a new id."""
    if os.environ.get("TRILLORA_REQUIRE_BENCH") != "1":
        pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    base = [
        f"out_dir={tmp_path}",
        "name=tracked",
        *SMALL_RUN,
        "eval_every=2",
        'logging.backends=["wandb"]',
        "checkpoint.every=2",
    ]
    Trainer(load_config(None, [*base, "steps=2"])).run()
    run = tmp_path / "tracked"
    first_id = (run / "wandb" / "run_id").read_text()
    Trainer(load_config(None, [*base, "steps=4", "resume=true"])).run()
    folders = sorted((run / "wandb").glob("offline-run-*"))
    # both folders are the first run's id; wandb adds "-1" when the resumed one starts in the same second
    assert len(folders) == 2 and all(
        re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{first_id}(-\d+)?", f.name) for f in folders
    )
    later = max(folders, key=lambda f: f.stat().st_mtime)
    (records,) = later.glob("run-*.wandb")
    assert sorted({h["_step"] for h in wandb_history(records)}) == [3, 4]
    Trainer(load_config(None, [*base, "steps=1", "eval_every=1"])).run()  # a fresh run in the same folder
    assert (run / "wandb" / "run_id").read_text() != first_id


def wandb_history(path) -> list[dict]:
    """The history rows of an offline W&B run file: W&B's own Record protobufs in its log format
    (a 7-byte ':W&B' header, then 32 KiB blocks of records, each with a 7-byte header: crc32,
    length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, pos, rows, parts = path.read_bytes(), 32768, 7, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record
            record = Record()
            record.ParseFromString(parts)
            parts = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_an_unknown_backend_names_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"logging.backends: 'mlflow' is not a backend; allowed: tensorboard, wandb"):
        load_config(None, ['logging.backends=["mlflow"]'])
