"""Dirty datasets: malformed, empty and over-length rows fail naming file and line, or with
`bad_rows = "skip"` are left out and counted; nothing else is lost."""

from __future__ import annotations

import json

import pytest

from trillora.config import load_config
from trillora.tasks import DatasetError, JsonlTask
from trillora.trainer import Trainer

REWARD = "trillora.tasks.rewards:exact_match"


@pytest.fixture
def dirty(tmp_path):
    good = [json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) for a in range(60)]
    lines = (
        good[:10]
        + [
            '{"prompt": "1+',
            '["a list"]',
            '{"prompt": "   "}',
            '{"answer": "2"}',
            json.dumps({"prompt": "9" * 300 + "+1=", "answer": "x"}),
        ]
        + good[10:]
    )
    path = tmp_path / "dirty.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    "bad,message",
    [
        ('{"prompt": "1+', "invalid JSON"),
        ('["a list"]', "a row must be a JSON object, got list"),
        ('{"prompt": "   "}', "missing or empty string field 'prompt'"),
    ],
)
def test_each_bad_row_fails_naming_file_and_line(tmp_path, bad, message):
    good = json.dumps({"prompt": "1+1=", "answer": "2"})
    path = tmp_path / "one.jsonl"
    path.write_text("\n".join([good] * 10 + [bad]) + "\n")
    with pytest.raises(DatasetError, match=f"^{path}:11: {message}"):
        JsonlTask(path=str(path), reward_fn=REWARD)


def test_skip_counts_bad_rows_and_keeps_the_rest(dirty):
    task = JsonlTask(path=str(dirty), reward_fn=REWARD, bad_rows="skip")
    assert len(task.skipped) == 4 and [s.split(":")[1] for s in task.skipped] == ["11", "12", "13", "14"]
    assert len(task._rows) == 61  # 60 good rows and the long one (its length is checked against the model)


def test_over_length_prompts_fail_or_are_skipped_by_the_trainer(dirty, tmp_path):
    options = f'task.options={{path = "{dirty}", reward_fn = "{REWARD}", bad_rows = "fail"}}'
    common = [f"out_dir={tmp_path}", "task.name=jsonl", 'task.retention=""', "rollout.max_model_len=64"]
    with pytest.raises(DatasetError, match=f"{dirty}:11: invalid JSON"):
        Trainer(load_config(None, [*common, options]))
    clean = tmp_path / "clean.jsonl"
    clean.write_text(
        "\n".join(x for i, x in enumerate(dirty.read_text().splitlines()) if i not in (10, 11, 12, 13)) + "\n"
    )
    options = f'task.options={{path = "{clean}", reward_fn = "{REWARD}"}}'
    with pytest.raises(
        DatasetError,
        match=rf"{clean}:11: prompt of 304 tokens is over the 58 allowed "
        r"\(rollout.max_model_len=64 - rollout.max_new_tokens=6\)",
    ):
        Trainer(load_config(None, [*common, options]))
    options = f'task.options={{path = "{dirty}", reward_fn = "{REWARD}", bad_rows = "skip"}}'
    trainer = Trainer(
        load_config(
            None,
            [
                *common,
                options,
                "steps=1",
                "eval_every=1",
                "rollout.prompts_per_step=4",
                "rollout.group_size=2",
                "task.eval_problems=4",
            ],
        )
    )
    assert len(trainer.task.skipped) == 5 and "prompt of 304 tokens" in trainer.task.skipped[-1]
    assert trainer.run()["dataset_rows_skipped"] == 5


HOSTILE = [
    (b'{"prompt": "caf\xe9 1+1="}', r"not UTF-8 \(byte 15"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"prompt": "1+1=", "n": ' + b"9" * 5000 + b"}", "Exceeds the limit"),
]


@pytest.mark.parametrize("bad,message", HOSTILE, ids=["invalid-utf8", "deep", "huge-int"])
def test_hostile_rows_fail_naming_file_and_line_or_are_skipped(tmp_path, bad, message):
    good = json.dumps({"prompt": "1+1=", "answer": "2"}).encode()
    path = tmp_path / "hostile.jsonl"
    path.write_bytes(b"\n".join([good] * 3 + [bad] + [good] * 2) + b"\n")
    with pytest.raises(DatasetError, match=f"^{path}:4: .*{message}"):
        JsonlTask(path=str(path), reward_fn=REWARD)
    task = JsonlTask(path=str(path), reward_fn=REWARD, bad_rows="skip")
    assert len(task._rows) == 5 and len(task.skipped) == 1 and task.skipped[0].startswith(f"{path}:4: ")


def test_hostile_parquet_and_toml_name_the_file(tmp_path):
    from trillora.config import ConfigError

    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1" + b"\x00" * 64 + b"PAR1")
    with pytest.raises(DatasetError, match=f"^{broken}: cannot read it as parquet"):
        JsonlTask(path=str(broken), reward_fn=REWARD)
    for name, raw, message in [
        ("latin1.toml", b'name = "x"\nsteps = 3\n# caf\xe9\n', r"latin1.toml:3: not UTF-8"),
        ("deep.toml", b"a = " + b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        ("huge.toml", b"steps = " + b"9" * 5000, "huge.toml: Exceeds the limit"),
    ]:
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(ConfigError, match=message):
            load_config(tmp_path / name)
    with pytest.raises(ConfigError, match="override 'steps': ValueError"):
        load_config(None, ["steps=" + "9" * 5000])
