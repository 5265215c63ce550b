"""Reward functions given to JSONL tasks as `module:function` in tests."""


def exact(completion: str, row: dict) -> float:
    return float(completion.strip() == row["answer"])


NOT_CALLABLE = 3
