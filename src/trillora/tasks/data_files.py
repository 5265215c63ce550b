"""Dataset rows from the files people have: JSONL, Parquet and Arrow files, and folders written by
`datasets.Dataset.save_to_disk` (verl's data is Parquet). Every row comes with where it is (`file:line`
for JSONL, `file row N` otherwise), so a bad one is reported by its place.

Chat rows carry OpenAI-format messages (`messages`, or a list under the prompt key as verl writes
`prompt`): a list of `{"role": ..., "content": ...}` objects, roles among system / user / assistant /
tool.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

ROLES = ("system", "user", "assistant", "tool")
SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")


class RowError(ValueError):
    pass


def iter_rows(path: Path, split: str = "train") -> Iterator[tuple[str, object]]:
    """(where, row or the RowError that row is) for each row of `path`."""
    if path.is_dir():
        yield from _from_datasets(path, _load_folder(path, split))
        return
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with open(path, "rb") as f:  # decoded per line: one bad line is that row's error, not the file's
            for lineno, raw in enumerate(f, 1):
                yield from _json_row(f"{path}:{lineno}", raw)
        return
    if suffix not in SUFFIXES:
        raise RowError(
            f"{path}: unknown data file type {suffix!r}; allowed: {', '.join(SUFFIXES)}, or a folder "
            f"written by datasets' save_to_disk"
        )
    datasets = _datasets()
    try:
        table = (
            datasets.Dataset.from_parquet(str(path)) if suffix == ".parquet" else datasets.Dataset.from_file(str(path))
        )
    except Exception as e:  # noqa: BLE001 - pyarrow's and datasets' many errors, named with the file
        raise RowError(f"{path}: cannot read it as {suffix[1:]} ({type(e).__name__}: {str(e)[:300]})") from None
    yield from _from_datasets(path, table)


def _json_row(where: str, raw: bytes) -> Iterator[tuple[str, object]]:
    """A line's row, or the RowError it is: not UTF-8, not JSON, nested too deeply, a number too long."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        yield where, RowError(f"not UTF-8 (byte {e.start} of the line: {raw[e.start : e.start + 1]!r})")
        return
    if not line.strip():
        return
    try:
        yield where, json.loads(line)
    except json.JSONDecodeError as e:
        yield where, RowError(f"invalid JSON ({e.msg}, column {e.colno})")
    except RecursionError:
        yield where, RowError("JSON nested too deeply")
    except ValueError as e:  # an integer past Python's digit limit
        yield where, RowError(f"invalid JSON ({e})")


def _datasets():
    try:
        import datasets
    except ImportError:  # pragma: no cover - a dependency of trillora
        raise RowError(
            "Parquet, Arrow and datasets folders are read with the `datasets` library: pip install datasets"
        ) from None
    return datasets


def _load_folder(path: Path, split: str):
    datasets = _datasets()
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise RowError(f"{path}: not a folder written by datasets' save_to_disk ({e})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise RowError(f"{path}: no split {split!r}; it has: {', '.join(loaded)}")
        loaded = loaded[split]
    return loaded


def _from_datasets(path: Path, table) -> Iterator[tuple[str, object]]:
    for i, row in enumerate(table):
        yield f"{path} row {i}", row


def check_messages(messages: object, key: str) -> list[dict]:
    """OpenAI-format messages, or a RowError naming the key, the message and what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise RowError(f"{key!r} must be a non-empty list of messages")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RowError(f"{key}[{k}] must be an object with role and content, got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise RowError(f"{key}[{k}].role is {m.get('role')!r}; allowed: {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise RowError(f"{key}[{k}].content must be a string")
        out.append({k2: v for k2, v in m.items() if v is not None})  # Arrow fills absent fields with None
    return out
