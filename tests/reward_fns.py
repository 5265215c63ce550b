"""Reward functions given to JSONL tasks as `module:function` in tests."""


def exact(completion: str, row: dict) -> float:
    return float(completion.strip() == row["answer"])


NOT_CALLABLE = 3


def contains_answer(completion: str, row: dict) -> float:
    """verl's rows keep the answer under reward_model.ground_truth; ours under answer."""
    truth = row.get("reward_model", {}).get("ground_truth") or row.get("answer") or row["messages"][-1]["content"]
    return float(str(truth) in completion)
