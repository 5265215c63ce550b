"""A long-horizon env of another shape than the ledger: a few registers written and overwritten over
many turns, and at the end the question about the one whose last write came early. Reward 1 when the
answer is its last value.

    task.name = "env"
    task.options = { env = "trillora.envs.registers:dataset", turns = 8, writes = 3, registers = 5 }

The turns are the ledger's (`LedgerEnv`: "remember:", a line per policy turn, then "c?"), but what
must be kept differs. In the ledger each fact is written once and the distractors look different
(upper-case keys), so a memory can keep facts by their form. Here every line is register writes of
one form ("c=4 f=1"): the asked register is written at turn 1 and last at a turn in 2..`asked_from`
(with the default `asked_from = 2`, the turn-1 copy always holds another value: a stale one), and
after that the other registers are rewritten again and again. A memory must keep the asked
register's last write and may drop both its stale copy and the many later writes that look just
like it; retrieval by "c=" matches the stale write and the current one alike (of equal scores it
returns the newer).
"""

from __future__ import annotations

import random

from .env_dataset import SeededDataset
from .ledger import KEYS, episodes, refill_kept

__all__ = ["dataset", "episode", "refill_kept"]


def episode(rng: random.Random, turns: int, writes: int, count: int, asked_from: int) -> tuple[list[str], str, int]:
    """The lines of one episode (`writes` writes each), the register asked about and its last value.

    The asked register is written at turn 1 and last at turn `last` (2..asked_from), maybe in
    between, never after, each write a value other than the one before it (from the third write on,
    an older one may come back); the other writes of a line go to distinct ones of the `count - 1`
    others."""
    keys = rng.sample(KEYS, count)
    asked, others = keys[0], keys[1:]
    last = rng.randint(min(2, turns), min(asked_from, turns))
    value = rng.randint(0, 9)
    lines = []
    for turn in range(1, turns + 1):
        written = turn == 1 or turn == last or (turn < last and rng.random() < 0.5)
        parts = [f"{key}={rng.randint(0, 9)}" for key in rng.sample(others, writes - written)]
        if written:  # a new value (the first write: any value)
            value = rng.choice([v for v in range(10) if v != value]) if turn > 1 else value
            parts.append(f"{asked}={value}")
        rng.shuffle(parts)
        lines.append(" ".join(parts))
    return lines, asked, value


def dataset(
    tokenizer,
    batch_size: int,
    group_size: int,
    eval_size: int,
    seed: int,
    turns: int = 8,
    writes: int = 3,
    registers: int = 5,
    asked_from: int = 2,
) -> SeededDataset:
    if turns < 2 or not 1 <= writes < registers <= len(KEYS) or asked_from < 2:
        raise ValueError(
            f"registers needs turns >= 2, 1 <= writes < registers <= {len(KEYS)} and asked_from >= 2 (the asked "
            f"register is written twice); got turns={turns}, writes={writes}, registers={registers}, "
            f"asked_from={asked_from}"
        )
    draw = episodes(tokenizer, lambda rng: episode(rng, turns, writes, registers, asked_from), name="registers")
    return SeededDataset(*draw, batch_size, group_size, eval_size, seed)
