"""A dataset task: JSONL rows with a `prompt` and whatever the reward needs, scored by a user
function named `module:function` taking (completion: str, row: dict) -> float."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TrilloraError
from .base import Problem, Task, in_eval_split, load_callable


class DatasetError(TrilloraError, ValueError):
    """A malformed dataset row; the message names the file and line."""


def load_reward_fn(spec: str) -> Callable[[str, dict], float]:
    return load_callable(spec, "reward function")


BAD_ROWS = ("fail", "skip")


def read_rows(path: Path, prompt_key: str, bad_rows: str = "fail") -> tuple[list[dict], list[int], list[str]]:
    """(rows, their line numbers, what was skipped): a bad row raises naming its file and line, or
    with bad_rows="skip" is left out and described."""
    if bad_rows not in BAD_ROWS:
        raise DatasetError(f"{path}: bad_rows={bad_rows!r}; allowed: {', '.join(BAD_ROWS)}")
    rows, lines, skipped = [], [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise DatasetError(f"{path}:{lineno}: a row must be a JSON object, got {type(row).__name__}")
                if not isinstance(row.get(prompt_key), str) or not row[prompt_key].strip():
                    raise DatasetError(f"{path}:{lineno}: missing or empty string field {prompt_key!r}")
            except json.JSONDecodeError as e:
                problem = DatasetError(f"{path}:{lineno}: invalid JSON ({e.msg})")
            except DatasetError as e:
                problem = e
            else:
                rows.append(row)
                lines.append(lineno)
                continue
            if bad_rows == "fail":
                raise problem from None
            skipped.append(str(problem))
    if not rows:
        raise DatasetError(f"{path}: no rows" + (f" ({len(skipped)} skipped; first: {skipped[0]})" if skipped else ""))
    return rows, lines, skipped


@dataclass
class JsonlTask(Task):
    path: str = ""
    reward_fn: str = ""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    bad_rows: str = "fail"
    """A malformed, empty or over-length row: "fail" names its file and line; "skip" leaves it out
    and counts it (`skipped`)."""
    name: str = "jsonl"
    skipped: list[str] = field(default_factory=list)
    _rows: list[dict] = field(default_factory=list, repr=False)
    _lines: list[int] = field(default_factory=list, repr=False)
    _fn: Callable | None = field(default=None, repr=False)
    _splits: dict[str, list[dict]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._rows, self._lines, self.skipped = read_rows(Path(self.path), self.prompt_key, self.bad_rows)
        self._fn = load_reward_fn(self.reward_fn)

    def limit_prompt_tokens(self, count: Callable[[str], int], limit: int, why: str) -> None:
        """Rows whose prompt is over `limit` tokens fail or are skipped, as `bad_rows` says."""
        keep = []
        for row, line in zip(self._rows, self._lines):
            n = count(row[self.prompt_key])
            if n <= limit:
                keep.append((row, line))
                continue
            problem = f"{self.path}:{line}: prompt of {n} tokens is over the {limit} allowed ({why})"
            if self.bad_rows == "fail":
                raise DatasetError(problem + "; shorten it, raise the limit, or set bad_rows = \"skip\"")
            self.skipped.append(problem)
        if not keep:
            raise DatasetError(f"{self.path}: every row is over-length ({self.skipped[-1]})")
        self._rows, self._lines = [r for r, _ in keep], [n for _, n in keep]
        self._splits.clear()

    def _problem(self, row: dict) -> Problem:
        return Problem(prompt=row[self.prompt_key], answer=str(row.get(self.answer_key, "")), data=row)

    def sample(self, rng: random.Random) -> Problem:
        return self._problem(rng.choice(self._rows))

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        if split not in self._splits:  # hashing every prompt once, not at every step
            self._splits[split] = [r for r in self._rows
                                   if in_eval_split(r[self.prompt_key], self.eval_fraction) == (split == "eval")]
        pool = self._splits[split]
        if not pool:
            raise DatasetError(f"{self.path}: no rows fall in the {split!r} split")
        rng = random.Random(f"{self.name}:{split}:{seed}")
        return [self._problem(rng.choice(pool)) for _ in range(n)]

    def reward(self, problem: Problem, completion: str) -> float:
        return float(self._fn(completion, problem.data))
