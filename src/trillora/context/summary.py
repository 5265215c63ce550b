"""The reasoning-based baseline for Memory Diffusion: after every turn the policy summarises what it
has seen, and the context becomes the task, that summary and the latest turn.

The summary is sampled from the context so far (the task, the last summary, the turns since)
followed by the marker "[[summary]] N:", N its token budget (at most `max_tokens`, and what the
latest turn leaves). Like a refill it is a policy action, trained with the episode's reward.
"""

from __future__ import annotations

import dataclasses

from .context import Chunk, Truncate, size
from .diffusion import Refill


class Summarize:
    every_turn = True  # rewrites the context after every turn, not only when it would overflow

    def __init__(self, engine, tokenizer, params, max_tokens: int = 32):
        self.engine, self.tokenizer, self.params, self.max_tokens = engine, tokenizer, params, max_tokens
        self.refills: list[Refill] = []
        self.calls = 0

    def compress(self, chunks: list[Chunk], limit: int) -> list[Chunk]:
        if len(chunks) < 3:  # the task and one turn: nothing to summarise yet
            return chunks if size(chunks) <= limit else Truncate().compress(chunks, limit)
        head, latest = chunks[0], chunks[-1]
        budget = min(self.max_tokens, limit - size([head, latest]))
        if budget <= 0:
            return Truncate().compress(chunks, limit)
        marker = self.tokenizer(f"\n[[summary]] {budget}:\n", add_special_tokens=False)["input_ids"]
        prompt = [t for c in chunks[:-1] for t in c.tokens] + marker
        self.calls += 1
        seed = None if self.params.seed is None else self.params.seed * 7919 + self.calls
        params = dataclasses.replace(self.params, max_new_tokens=budget, seed=seed)
        (completion,) = self.engine.generate([prompt], 1, params)[0]
        self.refills.append(Refill(prompt, list(completion.token_ids), list(completion.logprobs)))
        summary = [t for t in completion.token_ids if t not in params.stop_token_ids][:budget]
        return [head, Chunk(summary, chunks[-2].turn), latest]
