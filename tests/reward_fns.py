"""Reward functions given to JSONL tasks as `module:function` in tests."""


def exact(completion: str, row: dict) -> float:
    return float(completion.strip() == row["answer"])


NOT_CALLABLE = 3


def contains_answer(completion: str, row: dict) -> float:
    """verl's rows keep the answer under reward_model.ground_truth; ours under answer."""
    truth = row.get("reward_model", {}).get("ground_truth") or row.get("answer") or row["messages"][-1]["content"]
    return float(str(truth) in completion)


def served_tokens(calls) -> float:
    """A trace reward computed at training time (`learn.reward`): 1 for a trace of at most 8 completion tokens."""
    return float(sum(len(c.completion_ids) for c in calls) <= 8)


def not_a_number(calls) -> float:
    return float("nan")


def even_first_token(calls) -> float:
    """A reward that depends on what was sampled (the traces gate's replays): 1 when the first call's
    first completion token id is even."""
    ids = calls[0].completion_ids
    return float(bool(ids) and ids[0] % 2 == 0)


def stalls_when_told(completion: str, row: dict) -> float:
    """`exact`, but once the file named by TRILLORA_TEST_STALL exists it touches FILE.asleep and
    sleeps ten minutes: a reward in progress when a run is interrupted."""
    import os
    import time
    from pathlib import Path

    marker = os.environ.get("TRILLORA_TEST_STALL")
    if marker and os.path.exists(marker):
        Path(marker + ".asleep").touch()
        time.sleep(600)
    return exact(completion, row)
