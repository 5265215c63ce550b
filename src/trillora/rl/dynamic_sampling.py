"""Dynamic sampling (DAPO, arXiv:2503.14476): a group whose G rewards are all equal has zero
advantage everywhere and teaches nothing; drop it and fill the batch from more prompts."""

from __future__ import annotations

import torch


def informative_groups(rewards_PG: torch.Tensor) -> torch.Tensor:
    """[P] True where a group's rewards are not all equal."""
    return (rewards_PG != rewards_PG[:, :1]).any(dim=1)


def fill_batch(rounds: list[torch.Tensor], want: int) -> tuple[list[tuple[int, int]], int]:
    """Which groups make a batch of `want`: the informative ones in sampling order (round by round),
    then, if the rounds ran out, uninformative ones so the batch keeps its size (they add no
    gradient). Returns [(round, group)] and how many uninformative groups were kept."""
    keep = [(k, int(i)) for k, r in enumerate(rounds) for i in informative_groups(r).nonzero()[:, 0]][:want]
    filler = [(k, int(i)) for k, r in enumerate(rounds) for i in (~informative_groups(r)).nonzero()[:, 0]]
    padding = filler[: want - len(keep)]
    return sorted(keep + padding), len(padding)


def little_signal(all_equal_S: list[float], window: int = 5, threshold: float = 0.75) -> float | None:
    """The share of groups whose samples all got one reward, averaged over the last `window` steps,
    when it is at least `threshold`; else None. Such groups have zero group-relative advantage and
    add no gradient, so a run where most groups are like that learns little or nothing (a task too
    easy or too hard for the model, a reward that never varies). `all_equal_S`: each step's share
    (`groups_all_equal`), oldest first. The default job stays near 0.3 (at most 0.53 in one step)."""
    if len(all_equal_S) < window:
        return None
    share = sum(all_equal_S[-window:]) / window
    return share if share >= threshold else None
