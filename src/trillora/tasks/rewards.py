"""Reward functions for JSONL tasks, named as `trillora.tasks.rewards:NAME`."""

from __future__ import annotations

from .base import first_line


def exact_match(completion: str, row: dict) -> float:
    """1 when the completion's first line equals the row's `answer` field (both stripped)."""
    return float(first_line(completion) == str(row.get("answer", "")).strip())
