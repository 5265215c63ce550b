"""A multi-turn episode's context under a token budget: what the policy sees when the whole
trajectory would not fit (the memory layer of Memory Diffusion and its baselines).

The env keeps its own history and gives the whole of it each turn. The layer keeps the context
the policy actually saw, as chunks: the initial observation (turn 0: the task, always kept) and,
per turn, the policy's action with what the env added after it. A new observation that extends
the env's previous one + the action only adds a chunk; before the policy sees it, a context over
`budget − reserve` tokens (`reserve`: the room the next action needs) is handed to the memory
policy, which returns chunks that fit. A rewrite breaks the prefix property, so the trajectory's
next turn starts a new training sample there (`tasks.trajectory.merge_trajectory`).
Chunking: by turn, or each turn cut into spans of `span_tokens` (finer choices for the policy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass
class Chunk:
    tokens: list[int]
    turn: int  # 0: the initial observation; k: turn k's action and the env's reply to it


class MemoryPolicy(Protocol):
    def compress(self, chunks: list[Chunk], limit: int) -> list[Chunk]:
        """Chunks holding at most `limit` tokens when that is possible (chunks[0], the task, stays)."""


def size(chunks: list[Chunk]) -> int:
    return sum(len(c.tokens) for c in chunks)


def split_spans(
    chunks: list[Chunk], span_tokens: int, cuts: Callable[[list[int]], set[int]] | None = None
) -> list[Chunk]:
    """Each turn's chunk cut into spans of at most `span_tokens` (the initial observation stays whole).
    With `cuts` (a chunk's tokens -> the positions between words, `word_cuts`), a span ends at the last
    word edge that fits, so that a fact ("c=4") is not split across two spans; a word longer than a
    span is cut where the span ends."""
    out = []
    for c in chunks:
        if c.turn == 0 or len(c.tokens) <= span_tokens:
            out.append(c)
            continue
        edges, start = (cuts(c.tokens) if cuts else set()), 0
        while start < len(c.tokens):
            end = min(start + span_tokens, len(c.tokens))
            fits = [j for j in edges if start < j <= end]
            end = max(fits) if fits and end < len(c.tokens) else end
            out.append(Chunk(c.tokens[start:end], c.turn))
            start = end
    return out


def word_cuts(tokenizer) -> Callable[[list[int]], set[int]]:
    """The positions between words in a token list: after a token whose text ends in whitespace or
    before one whose text starts with it (byte-level BPE spells a word's leading space as part of it)."""
    texts: dict[int, str] = {}

    def text(t: int) -> str:
        if t not in texts:
            texts[t] = tokenizer.decode([t])
        return texts[t]

    def cuts(tokens: list[int]) -> set[int]:
        return {j for j in range(1, len(tokens)) if text(tokens[j - 1])[-1:].isspace() or text(tokens[j])[:1].isspace()}

    return cuts


class MemoryContext:
    """One episode's context as the policy sees it; `start` and `step` return it as token ids."""

    def __init__(
        self,
        policy: MemoryPolicy,
        budget: int,
        reserve: int,
        span_tokens: int = 0,
        cuts: Callable[[list[int]], set[int]] | None = None,
    ):
        if budget <= reserve:
            raise ValueError(f"memory.budget={budget} leaves no room for a turn of {reserve} new tokens")
        self.policy, self.budget, self.reserve, self.span_tokens = policy, budget, reserve, span_tokens
        self.cuts = cuts  # spans end between words (`word_cuts`), or every `span_tokens` when None
        self.full: list[int] = []  # the env's last observation (its whole history)
        self.chunks: list[Chunk] = []
        self.rewrites = 0  # times the policy rewrote the context
        self.dropped = 0  # tokens the policy removed, in all

    def start(self, observation: list[int]) -> list[int]:
        self.full, self.chunks = list(observation), [Chunk(list(observation), 0)]
        return self._fit()

    def step(self, action: list[int], observation: list[int], turn: int) -> list[int]:
        """The next context: the env's new tokens after the context the policy last saw + its action."""
        return _run(self._advance(action, observation, turn, batched=False))

    def stepping(self, action: list[int], observation: list[int], turn: int):
        """`step` as a generator: a policy that refills (`compressing`) yields its requests once and
        takes what was sampled for them, so that a runner samples many episodes' in one call."""
        return self._advance(action, observation, turn, batched=True)

    def _advance(self, action: list[int], observation: list[int], turn: int, batched: bool):
        previous, full = self.full + list(action), list(observation)
        if full[: len(previous)] == previous:
            self.chunks.append(Chunk(list(action) + full[len(previous) :], turn))
        else:  # the env rewrote its own history: start over from it
            self.chunks = [Chunk(full, 0)]
        self.full = full
        return (yield from self._fitting(batched))

    def intercept(self, action: list[int], stop: tuple[int, ...], turn: int) -> list[int] | None:
        """A turn the memory answers itself (a `recall` call): the next context, or None for the env."""
        answer_to = getattr(self.policy, "answer_to", None)
        reply = answer_to(list(action), tuple(stop)) if answer_to is not None else None
        if reply is None:
            return None
        self.chunks.append(Chunk(list(action) + reply, turn))  # the env never sees this turn
        return _run(self._fitting(batched=False))

    def take_refills(self) -> list:
        """What the policy sampled to rewrite the context since the last call (trained as actions)."""
        refills = getattr(self.policy, "refills", None)
        if not refills:
            return []
        taken, refills[:] = list(refills), []
        return taken

    def take_scoring_flops(self) -> float:
        """FLOPs of the forwards the policy ran to score chunks since the last call."""
        flops = getattr(self.policy, "scoring_flops", 0.0)
        if flops:
            self.policy.scoring_flops = 0.0
        return flops

    def _fit(self) -> list[int]:
        return _run(self._fitting(batched=False))

    def _fitting(self, batched: bool):
        limit = self.budget - self.reserve
        if size(self.chunks) > limit or (getattr(self.policy, "every_turn", False) and len(self.chunks) > 2):
            chunks = split_spans(self.chunks, self.span_tokens, self.cuts) if self.span_tokens else self.chunks
            before = size(chunks)
            if batched and hasattr(self.policy, "compressing"):
                self.chunks = yield from self.policy.compressing(chunks, limit)
            else:  # sampled by the policy itself, one episode alone
                self.chunks = self.policy.compress(chunks, limit)
            self.rewrites += 1
            self.dropped += before - size(self.chunks)
        return [t for c in self.chunks for t in c.tokens]


def _run(steps):
    """A generator that never yields, run to its return value."""
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a context stepped alone asked for refills to be sampled elsewhere")


class Truncate:
    """The simplest memory: drop the oldest chunks after the task until the rest fits."""

    def compress(self, chunks: list[Chunk], limit: int) -> list[Chunk]:
        head, rest = chunks[:1], list(chunks[1:])
        while rest and size(head) + size(rest) > limit:
            rest.pop(0)
        return head + rest
