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
