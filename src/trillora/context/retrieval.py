"""The tool-based baseline for Memory Diffusion: truncation, with what it drops kept in a store the
policy can search through a `recall` tool (BM25 over the dropped chunks).

A policy turn whose text starts with "recall:" is the tool call: its rest is the query, and the
memory answers it instead of the env — the turn, then "[recalled]" and the best-matching dropped
chunk (nothing when none matches) join the context, and the env never sees that turn. Terms are
token ids, so the store needs no tokenizer of its own.
"""

from __future__ import annotations

import math
from collections import Counter

from .context import Chunk, Truncate

K1, B = 1.5, 0.75


def bm25(query: list[int], docs: list[list[int]]) -> list[float]:
    """Okapi BM25 of each doc for the query's terms (idf = ln(1 + (N − n + 0.5) / (n + 0.5)))."""
    if not docs:
        return []
    avg = sum(len(d) for d in docs) / len(docs)
    df = Counter(t for d in docs for t in set(d))
    scores = []
    for d in docs:
        tf, s = Counter(d), 0.0
        for t in set(query):
            if tf[t]:
                idf = math.log(1 + (len(docs) - df[t] + 0.5) / (df[t] + 0.5))
                s += idf * tf[t] * (K1 + 1) / (tf[t] + K1 * (1 - B + B * len(d) / max(avg, 1e-9)))
        scores.append(s)
    return scores


class Recall:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.call = self._text("recall:")
        self.answer = self._text("\n[recalled]\n")
        self.store: list[Chunk] = []
        self.recalls = 0

    def _text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def compress(self, chunks: list[Chunk], limit: int) -> list[Chunk]:
        kept = Truncate().compress(chunks, limit)
        self.store += [c for c in chunks if not any(c is k for k in kept)]
        return kept

    def answer_to(self, action: list[int], stop: tuple[int, ...]) -> list[int] | None:
        """What the memory adds after a `recall:` turn (None: not a call; the env takes the turn)."""
        if action[: len(self.call)] != self.call:
            return None
        self.recalls += 1
        query = [t for t in action[len(self.call) :] if t not in stop]
        scores = bm25(query, [c.tokens for c in self.store])
        best = max(range(len(scores)), key=lambda i: (scores[i], i), default=None)
        found = self.store[best].tokens if best is not None and scores[best] > 0 else []
        return self.answer + found + self._text("\n")
