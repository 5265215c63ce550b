"""A recorded trace as training sequences, by the prefix rule the envs use (`tasks.trajectory`).

Each served call is a turn: the prompt ids it was given, the completion ids it sampled and their
logprobs, all as served, never decoded and tokenized again. When a call's prompt extends the
previous call's prompt + completion token for token (a chat client sending the history back, and
the template rendering it to the same ids), the two share one sequence; when it does not (the
template rendered the history differently, or the client rewrote it), a new sequence starts.
A request with several choices continues along the one the next call extends; the others are
sequences of their own.
"""

from __future__ import annotations

from ..envs.env import Trajectory, Transition
from ..envs.trajectory import Sample, merge_trajectory
from .types import Call


def extends(prompt: list[int], call: Call) -> bool:
    """`prompt` starts with `call`'s prompt and completion (the prefix rule)."""
    seen = call.prompt_ids + call.completion_ids
    return len(prompt) >= len(seen) and prompt[: len(seen)] == seen


def samples_of(calls: list[Call]) -> list[Sample]:
    """The fewest sequences holding every call of one trace (calls in served order)."""
    responses: dict[str, list[Call]] = {}
    for c in calls:
        responses.setdefault(c.response_id, []).append(c)
    chain, others = [], []
    groups = list(responses.values())
    for i, choices in enumerate(groups):
        after = groups[i + 1][0].prompt_ids if i + 1 < len(groups) else None
        picked = next((c for c in choices if after is not None and extends(after, c)), choices[0])
        chain.append(Transition(picked.prompt_ids, picked.completion_ids, picked.logprobs, 0.0, False))
        others += [Sample.single_turn(c.prompt_ids, c.completion_ids, c.logprobs) for c in choices if c is not picked]
    return (merge_trajectory(Trajectory(chain, final_observation=[])) if chain else []) + others
