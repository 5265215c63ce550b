"""A dataset task: rows with a prompt and whatever the reward needs, scored by a user function named
`module:function` taking (completion: str, row: dict) -> float.

Rows come from JSONL, Parquet, Arrow or a `datasets` folder (`data_files`). A row's prompt is text
(`prompt`) or chat messages (`messages`, OpenAI format, or a list under `prompt` as in verl's
Parquet), rendered with the tokenizer's chat template; a chat row's last assistant message, if it
ends the list, is its reference answer rather than part of the prompt."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TrilloraError
from .base import Problem, Task, in_eval_split, load_callable
from .data_files import RowError, check_messages, iter_rows


class DatasetError(TrilloraError, ValueError):
    """A malformed dataset row; the message names the file and line."""


def load_reward_fn(spec: str) -> Callable[[str, dict], float]:
    return load_callable(spec, "reward function")


BAD_ROWS = ("fail", "skip")


def row_messages(row: dict, prompt_key: str, messages_key: str) -> list[dict] | None:
    """A chat row's messages (under `messages_key`, or a list under `prompt_key` as verl writes
    `prompt`); None for a text row."""
    if isinstance(row.get(prompt_key), list):
        return check_messages(row[prompt_key], prompt_key)
    if prompt_key not in row and messages_key in row:
        return check_messages(row[messages_key], messages_key)
    return None


def read_rows(
    path: Path, prompt_key: str, bad_rows: str = "fail", messages_key: str = "messages", split: str = "train"
) -> tuple[list[dict], list[str], list[str]]:
    """(rows, where each is, what was skipped): a bad row raises naming its file and line (or row),
    or with bad_rows="skip" is left out and described."""
    if bad_rows not in BAD_ROWS:
        raise DatasetError(f"{path}: bad_rows={bad_rows!r}; allowed: {', '.join(BAD_ROWS)}")
    if not path.exists():
        raise DatasetError(f"{path}: no such file or folder")
    rows, places, skipped = [], [], []
    try:
        for where, row in iter_rows(path, split):
            try:
                if isinstance(row, RowError):
                    raise row
                if not isinstance(row, dict):
                    raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
                messages = row_messages(row, prompt_key, messages_key)
                if messages is not None:
                    row = {**row, "__messages__": messages}
                elif not isinstance(row.get(prompt_key), str) or not row[prompt_key].strip():
                    raise RowError(
                        f"missing or empty string field {prompt_key!r} (or a {messages_key!r} list of chat messages)"
                    )
            except RowError as e:
                if bad_rows == "fail":
                    raise DatasetError(f"{where}: {e}") from None
                skipped.append(f"{where}: {e}")
                continue
            rows.append(row)
            places.append(where)
    except RowError as e:  # the file itself (type, split)
        raise DatasetError(str(e)) from None
    if not rows:
        raise DatasetError(f"{path}: no rows" + (f" ({len(skipped)} skipped; first: {skipped[0]})" if skipped else ""))
    return rows, places, skipped


@dataclass
class JsonlTask(Task):
    path: str = ""
    reward_fn: str = ""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    messages_key: str = "messages"
    split: str = "train"
    """The split of a `datasets` folder holding several."""
    bad_rows: str = "fail"
    """A malformed, empty or over-length row: "fail" names its file and line; "skip" leaves it out
    and counts it (`skipped`)."""
    name: str = "jsonl"
    skipped: list[str] = field(default_factory=list)
    _rows: list[dict] = field(default_factory=list, repr=False)
    _places: list[str] = field(default_factory=list, repr=False)
    _fn: Callable | None = field(default=None, repr=False)
    _splits: dict[str, list[dict]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._rows, self._places, self.skipped = read_rows(
            Path(self.path), self.prompt_key, self.bad_rows, self.messages_key, self.split
        )
        self._fn = load_reward_fn(self.reward_fn)

    @property
    def chat(self) -> bool:
        """Some rows are chat messages: prompts go through the chat template."""
        return any("__messages__" in r for r in self._rows)

    def limit_prompt_tokens(self, count: Callable[[Problem], int], limit: int, why: str) -> None:
        """Rows whose prompt is over `limit` tokens fail or are skipped, as `bad_rows` says."""
        keep = []
        for row, place in zip(self._rows, self._places, strict=True):
            n = count(self._problem(row))
            if n <= limit:
                keep.append((row, place))
                continue
            problem = f"{place}: prompt of {n} tokens is over the {limit} allowed ({why})"
            if self.bad_rows == "fail":
                raise DatasetError(problem + '; shorten it, raise the limit, or set bad_rows = "skip"')
            self.skipped.append(problem)
        if not keep:
            raise DatasetError(f"{self.path}: every row is over-length ({self.skipped[-1]})")
        self._rows, self._places = [r for r, _ in keep], [n for _, n in keep]
        self._splits.clear()

    def _problem(self, row: dict) -> Problem:
        messages = row.get("__messages__")
        if messages is None:
            return Problem(prompt=row[self.prompt_key], answer=str(row.get(self.answer_key, "")), data=row)
        answer = row.get(self.answer_key)
        if messages[-1]["role"] == "assistant" and len(messages) > 1:  # the reference answer
            answer, messages = (answer if answer is not None else messages[-1]["content"]), messages[:-1]
        data = {k: v for k, v in row.items() if k != "__messages__"}
        return Problem(
            prompt=_key(messages), answer=str(answer if answer is not None else ""), data=data, messages=messages
        )

    def sample(self, rng: random.Random) -> Problem:
        return self._problem(rng.choice(self._rows))

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        if split not in self._splits:  # hashing every prompt once, not at every step
            self._splits[split] = [
                r for r in self._rows if in_eval_split(self._problem(r).prompt, self.eval_fraction) == (split == "eval")
            ]
        pool = self._splits[split]
        if not pool:
            raise DatasetError(f"{self.path}: no rows fall in the {split!r} split")
        rng = random.Random(f"{self.name}:{split}:{seed}")
        return [self._problem(rng.choice(pool)) for _ in range(n)]

    def reward(self, problem: Problem, completion: str) -> float:
        return float(self._fn(completion, problem.data))


def _key(messages: list[dict]) -> str:
    """A chat prompt as text: what the held-out split hashes and logs show."""
    return json.dumps(messages, ensure_ascii=False, sort_keys=True)
