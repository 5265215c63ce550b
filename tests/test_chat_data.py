"""Chat-formatted data: OpenAI `messages` in JSONL, verl's Parquet, Arrow files and `datasets`
folders; prompts rendered with the tokenizer's chat template (transformers' rendering is the oracle)."""

from __future__ import annotations

import json

import datasets
import pytest

from trillora.tasks import DatasetError, JsonlTask
from trillora.tasks.prompts import encode_problem, stop_tokens
from trillora.tiny import build_chat_tokenizer

REWARD = "reward_fns:contains_answer"


def chat_row(i: int) -> dict:
    return {
        "messages": [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": f"{i}+{i}="},
            {"role": "assistant", "content": str(2 * i)},
        ]
    }


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_messages_rows_render_with_the_chat_template(tmp_path):
    task = JsonlTask(path=str(write_jsonl(tmp_path / "chat.jsonl", [chat_row(i) for i in range(40)])), reward_fn=REWARD)
    assert task.chat
    p = task.problems("train", 1, seed=0)[0]
    assert [m["role"] for m in p.messages] == ["system", "user"]  # the last assistant turn is the answer
    assert p.answer == str(2 * int(p.messages[1]["content"].split("+")[0]))
    tok = build_chat_tokenizer()
    oracle = tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False)
    assert encode_problem(tok, p) == tok(oracle, add_special_tokens=False)["input_ids"]
    assert stop_tokens(tok, chat=True) == tuple(sorted([tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]))
    train = {q.prompt for q in task.problems("train", 200, seed=1)}
    held = {q.prompt for q in task.problems("eval", 50, seed=1)}
    assert train and held and not train & held


@pytest.mark.parametrize(
    "row, message",
    [
        ({"messages": []}, "chat.jsonl:2: 'messages' must be a non-empty list"),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            r"chat.jsonl:2: messages\[0\].role is 'robot'; allowed: system",
        ),
        ({"messages": [{"role": "user", "content": 3}]}, r"chat.jsonl:2: messages\[0\].content must be a string"),
        ({"messages": ["hi"]}, r"chat.jsonl:2: messages\[0\] must be an object"),
        ({"question": "hi"}, "chat.jsonl:2: missing or empty string field 'prompt' \\(or a 'messages' list"),
    ],
)
def test_bad_chat_rows_name_file_line_and_key(tmp_path, row, message):
    path = write_jsonl(tmp_path / "chat.jsonl", [chat_row(1), row])
    with pytest.raises(DatasetError, match=message):
        JsonlTask(path=str(path), reward_fn=REWARD)
    skipping = JsonlTask(path=str(path), reward_fn=REWARD, bad_rows="skip")
    assert len(skipping.skipped) == 1 and len(skipping._rows) == 1


def verl_rows(n: int) -> list[dict]:
    """verl's layout: `prompt` a list of messages, the answer under reward_model.ground_truth."""
    return [
        {
            "data_source": "sums",
            "prompt": [{"role": "user", "content": f"{i}+1="}],
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        }
        for i in range(n)
    ]


def test_parquet_arrow_and_datasets_folders(tmp_path):
    table = datasets.Dataset.from_list(verl_rows(30))
    table.to_parquet(str(tmp_path / "train.parquet"))
    task = JsonlTask(path=str(tmp_path / "train.parquet"), reward_fn=REWARD)
    p = task.problems("train", 1, seed=0)[0]
    assert p.messages == [{"role": "user", "content": p.messages[0]["content"]}]
    assert p.data["reward_model"]["ground_truth"] == str(int(p.messages[0]["content"].split("+")[0]) + 1)
    datasets.DatasetDict({"train": table, "test": table.select(range(3))}).save_to_disk(str(tmp_path / "folder"))
    assert len(JsonlTask(path=str(tmp_path / "folder"), reward_fn=REWARD, split="test")._rows) == 3
    with pytest.raises(DatasetError, match="no split 'validation'; it has: train, test"):
        JsonlTask(path=str(tmp_path / "folder"), reward_fn=REWARD, split="validation")
    text = datasets.Dataset.from_list([{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)])
    text.save_to_disk(str(tmp_path / "plain"))
    arrow = next((tmp_path / "plain").glob("*.arrow"))
    task = JsonlTask(path=str(arrow), reward_fn=REWARD)
    assert not task.chat and task._places[4].endswith("row 4")
    bad = datasets.Dataset.from_list([{"prompt": "ok"}, {"prompt": ""}])
    bad.to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(DatasetError, match=r"bad.parquet row 1: missing or empty string field 'prompt'"):
        JsonlTask(path=str(tmp_path / "bad.parquet"), reward_fn=REWARD)
    (tmp_path / "data.csv").write_text("prompt\nx\n")
    with pytest.raises(DatasetError, match="unknown data file type '.csv'; allowed: .jsonl, .json, .parquet, .arrow"):
        JsonlTask(path=str(tmp_path / "data.csv"), reward_fn=REWARD)
