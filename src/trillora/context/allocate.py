"""Allocate: how many tokens each masked chunk may keep, from its importance. Pure functions.

Every rule returns integers `b_i` with 0 ≤ b_i ≤ length_i and Σ b_i ≤ budget: a chunk given its
whole length stays verbatim, one given 0 is dropped, one in between is refilled to fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def proportional(importance: list[float], lengths: list[int], budget: int) -> list[int]:
    """Shares of the budget in proportion to importance (negative counts as 0), never more than a
    chunk's length: what a capped chunk cannot use is shared again among the others (water
    filling). Whole tokens by largest remainder, ties to the earlier chunk."""
    _check(importance, lengths, budget)
    weights = [max(0.0, float(w)) for w in importance]
    share = [0.0] * len(lengths)
    open_, left = {i for i, n in enumerate(lengths) if n > 0 and weights[i] > 0}, float(budget)
    while open_ and left > 1e-9:
        total = sum(weights[i] for i in open_)
        capped = {i for i in open_ if share[i] + left * weights[i] / total >= lengths[i]}
        if not capped:
            for i in open_:
                share[i] += left * weights[i] / total
            break
        for i in capped:  # these take their whole length; the rest of the budget goes round again
            left -= lengths[i] - share[i]
            share[i] = float(lengths[i])
        open_ -= capped
    out = [min(lengths[i], math.floor(s + 1e-9)) for i, s in enumerate(share)]
    spare = min(budget, sum(lengths)) - sum(out)
    for i in sorted(range(len(out)), key=lambda i: (-(share[i] - out[i]), i)):
        if spare <= 0:
            break
        if out[i] < lengths[i] and share[i] - out[i] > 1e-9:
            out[i] += 1
            spare -= 1
    return out


def top_k(importance: list[float], lengths: list[int], budget: int) -> list[int]:
    """Whole chunks in order of importance (ties: the later chunk first) while they fit; the
    rest dropped. No chunk is refilled."""
    _check(importance, lengths, budget)
    out, left = [0] * len(lengths), budget
    for i in sorted(range(len(lengths)), key=lambda i: (-importance[i], -i)):
        if lengths[i] <= left:
            out[i], left = lengths[i], left - lengths[i]
    return out


def threshold(importance: list[float], lengths: list[int], budget: int, floor: float) -> list[int]:
    """Chunks with importance under `floor` dropped; the others share the budget proportionally."""
    kept = [w if w >= floor else 0.0 for w in importance]
    return proportional(kept, lengths, budget)


def at_least(
    rule: Callable[[list[float]], list[int]], importance: list[float], lengths: list[int], minimum: int
) -> list[int]:
    """`rule`'s budgets (importance -> budgets), with no chunk refilled in fewer than `minimum` tokens:
    a rewrite too short to hold a fact only loses it. The least important chunk under the minimum is
    dropped and the rule shares the budget again, until none is under it."""
    weights = list(importance)
    while True:
        out = rule(weights)
        small = [i for i, b in enumerate(out) if 0 < b < min(minimum, lengths[i])]
        if not small:
            return out
        weights[min(small, key=lambda i: (weights[i], i))] = 0.0


def _check(importance: list[float], lengths: list[int], budget: int) -> None:
    if len(importance) != len(lengths):
        raise ValueError(f"{len(importance)} importances for {len(lengths)} chunks")
    if budget < 0 or any(n < 0 for n in lengths):
        raise ValueError(f"budget {budget} and chunk lengths {lengths} must not be negative")
    if not all(math.isfinite(w) for w in importance):
        raise ValueError(f"importances must be finite, got {importance}")


RULES = {"proportional": proportional, "top_k": top_k, "threshold": threshold}
