"""Rows that teach the memory's own actions before RL, built from the transcripts of an env on the
ledger's turns (`EPISODES`: the ledger, the registers) through the memory code the benchmark plays
(so prompts match to the token):

- `refill_rows`: a Memory Diffusion fill-in-the-middle prompt (`refill_prompt`: the task, a span of
  the transcript cut as `MemoryContext` cuts it, a budget N) and the rewrite that keeps its facts:
  the lower-case `k=v` pairs that fit in N tokens, the upper-case distractors and the writes a
  later one in the span overwrites dropped.
- `recall_rows`: the context a truncating `Recall` memory shows at the question; when the asked
  fact is no longer in view the policy writes "recall:" and the key, reads what the store returns,
  then answers; when it is in view it answers at once.

Each row is (ids, mask): mask 1 on the policy's tokens, the ones trained.
"""

from __future__ import annotations

import random
import re

from ..context import Chunk, MemoryContext, Recall, refill_prompt, split_spans, word_cuts
from ..envs import registers
from ..envs.ledger import LedgerEnv, ledger

FACT = re.compile(r"(?<![A-Za-z])[a-z]=\d")
"""A fact the question may ask: a lower-case key, "=", a digit (distractor keys are upper case)."""

Row = tuple[list[int], list[int]]


def _registers(rng: random.Random, turns: int) -> tuple[list[str], str, int]:
    writes = rng.randint(1, 3)
    return registers.episode(rng, turns, writes, rng.randint(writes + 1, 6), turns)


EPISODES = {
    "ledger": lambda rng, turns: ledger(rng, turns, rng.randint(0, 3), turns),
    "registers": _registers,
}
"""A training episode of each env: `turns` lines (0-3 distractors, or 1-3 writes to 2-6 registers),
the question about any of them."""


def kept_facts(span: str, budget: int, after: str = "") -> str:
    """The rewrite a refill should write: the span's whole facts in order, each key's last write
    only (none whose key is written again later in the span or in the context `after` it), as many
    as fit in `budget` characters with a space between them (one token per character here)."""
    facts = FACT.findall(span)
    rewritten = {fact[0] for fact in FACT.findall(after)}
    out = ""
    for i, fact in enumerate(facts):
        if fact[0] in rewritten or any(later[0] == fact[0] for later in facts[i + 1 :]):
            continue
        joined = f"{out} {fact}" if out else fact
        if len(joined) > budget:
            break
        out = joined
    return out


def _episode(tokenizer, rng: random.Random, facts: int, env_name: str) -> tuple[LedgerEnv, list[int]]:
    lines, key, value = EPISODES[env_name](rng, facts)
    return LedgerEnv(lines, key, value, tokenizer), tokenizer("ok", add_special_tokens=False)["input_ids"]


def refill_rows(
    tokenizer,
    rng: random.Random,
    span_tokens: tuple[int, ...] = (0, 6),
    env_name: str = "ledger",
    refill_context: bool = False,
) -> list[Row]:
    """One episode's turns, whole or cut into spans (one of `span_tokens`, 0: whole turns); every span
    becomes a refill prompt with a budget under its length, its target `kept_facts` and the stop token.
    With `refill_context` the prompt also holds the spans after it up to a random later one (the
    context at some later turn), and the target leaves out the facts that context writes again."""
    env, ok = _episode(tokenizer, rng, rng.randint(1, 8), env_name)
    eos = tokenizer.eos_token_id
    head, _ = env.initial_observation()
    chunks, seen = [Chunk(list(head), 0)], list(head)
    for turn in range(1, len(env.lines) + 1):
        action = ok + [eos]
        history = env.step(action).next_observation
        chunks.append(Chunk(history[len(seen) :], turn))
        seen = history
    rows = []
    cut = rng.choice(span_tokens)
    spans = (split_spans(chunks, cut, word_cuts(tokenizer)) if cut else chunks)[1:]
    for k, span in enumerate(spans):
        if len(span.tokens) < 2:
            continue
        budget = rng.randint(1, len(span.tokens) - 1)
        after = [t for s in spans[k + 1 : rng.randint(k + 1, len(spans))] for t in s.tokens] if refill_context else None
        prompt = refill_prompt(
            head, span.tokens, budget, lambda s: tokenizer(s, add_special_tokens=False)["input_ids"], after
        )
        kept = kept_facts(tokenizer.decode(span.tokens), budget, tokenizer.decode(after or []))
        rewrite = tokenizer(kept, add_special_tokens=False)["input_ids"]
        target = rewrite + [eos]
        rows.append((prompt + target, [0] * len(prompt) + [1] * len(target)))
    return rows


def recall_rows(
    tokenizer, rng: random.Random, budgets: tuple[int, int] = (24, 80), span_tokens: int = 6, env_name: str = "ledger"
) -> list[Row]:
    """One episode played through a `Recall` memory at a random budget, the policy saying "ok" to
    each fact; at the question, "recall:" + key when the fact has left the context (then the answer
    after what the store returned), else the answer."""
    env, ok = _episode(tokenizer, rng, rng.randint(2, 8), env_name)
    eos, stop = tokenizer.eos_token_id, (tokenizer.eos_token_id,)

    def text(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    memory = MemoryContext(Recall(tokenizer), rng.randint(*budgets), 4, span_tokens, word_cuts(tokenizer))
    context = memory.start(env.initial_observation()[0])
    for turn in range(1, len(env.lines) + 2):
        action = ok + [eos]
        context = memory.step(action, env.step(action).next_observation, turn)
    answer = text(str(env.value)) + [eos]
    if f"{env.key}={env.value}" in tokenizer.decode(context):
        return [(context + answer, [0] * len(context) + [1] * len(answer))]
    call = text(f"recall:{env.key}=") + [eos]  # "=" too: the key alone also matches "ok"
    after = memory.intercept(call, stop, len(env.lines) + 2)
    if after[: len(context) + len(call)] == context + call:  # one sample: the call, the store's reply, the answer
        return [
            (
                after + answer,
                [0] * len(context)
                + [1] * len(call)
                + [0] * (len(after) - len(context) - len(call))
                + [1] * len(answer),
            )
        ]
    return [
        (context + call, [0] * len(context) + [1] * len(call)),
        (after + answer, [0] * len(after) + [1] * len(answer)),
    ]
