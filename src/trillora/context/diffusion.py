"""Memory Diffusion: when the context would overflow, Mask → Allocate → Refill. Mask: the chunks
between the task (kept) and the `keep_recent` latest turns (kept verbatim, as many of them as fit
beside the task) are the ones the memory may rewrite. Allocate: each masked chunk gets a token
budget from its importance (`allocate.RULES`) out of what the kept chunks leave. Refill: a chunk
whose budget covers it stays verbatim, one with budget 0 is dropped, and any other is rewritten by
the policy itself from a fill-in-the-middle prompt — the task, the marker "[[", the chunk, the
marker "]] N:" with its budget N — sampling at most N tokens. With `refill_context` the prompt also
holds what follows the chunk in the context ("[[" chunk "]]" after "\nN:"), so a refill can tell a
fact that later turns overwrote from one they did not. Refills are policy actions: the
episode runner adds each as a transition of its own (prompt: mask 0, refill: mask 1, the episode's
reward), so RL teaches the policy what to keep; the rewritten context around them is observation.

The refills of one rewrite are sampled in one engine call (`sample_refills`), and the episode runner
samples those of every episode that rewrites at a turn in one call too (`compressing` yields its
requests instead of sampling them).

Importance: `recency` (later chunks matter more), `surprise` (how much information a chunk carries
per token: its tokens' mean negative log-likelihood under the policy given everything before it; one
forward, and what a model cannot predict, a fact, outweighs what it can, an "ok"), `policy_scores`,
the policy's own judgement: how much the log-probability of the latest turn drops when the chunk is left out
(leave-one-out over the masked chunks, one batched forward), or `attention_mass`: how much
attention the latest turn's tokens pay to the chunk's tokens (softmax weights averaged over
layers and heads, summed over the turn's queries and the chunk's keys; one forward).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .allocate import RULES, at_least
from .context import Chunk, Truncate, size

Importance = Callable[[list[Chunk], list[int]], list[float]]
"""(all chunks, indices of the masked ones) -> one importance per masked chunk. One that runs the
model has `rows(chunks, masked)`: the lengths of the rows it forwards, so that they are counted."""


@dataclass(frozen=True)
class RefillRequest:
    """A fill-in-the-middle prompt and the most tokens its rewrite may take."""

    prompt: list[int]
    budget: int


@dataclass
class Refill:
    """One rewrite the policy sampled: trained like any action."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]


def recency(chunks: list[Chunk], masked: list[int]) -> list[float]:
    return [float(i) for i in masked]


def sample_refills(engine, params, requests: list[RefillRequest]) -> list[Refill]:
    """Every request's rewrite in one engine call: sampled up to the largest budget, each cut to its
    own (the first `budget` tokens are distributed as a call capped at `budget` would sample them)."""
    longest = max(r.budget for r in requests)
    out = engine.generate([r.prompt for r in requests], 1, dataclasses.replace(params, max_new_tokens=longest))
    refills = []
    for r, (completion,) in zip(requests, out, strict=True):
        tokens, logprobs = list(completion.token_ids), list(completion.logprobs)
        refills.append(Refill(r.prompt, tokens[: r.budget], logprobs[: r.budget]))
    return refills


def refill_prompt(
    task: list[int],
    chunk: list[int],
    budget: int,
    text: Callable[[str], list[int]],
    after: list[int] | None = None,
) -> list[int]:
    """The fill-in-the-middle prompt a refill is sampled from: task "\n[[" chunk "]] N:\n", or with
    the context `after` the chunk, task "\n[[" chunk "]]" after "\nN:\n"."""
    if after is None:
        return task + text("\n[[") + chunk + text(f"]] {budget}:\n")
    return task + text("\n[[") + chunk + text("]]") + after + text(f"\n{budget}:\n")


NextTokenLogprobs = Callable[[torch.Tensor], torch.Tensor]
"""The policy's log p(each next token | the tokens before it): ids [B, T] -> [B, T-1], no gradient
(`policy.logprobs.next_token_logprobs`: the one place logprobs are read off the head)."""


def surprise(logprobs: NextTokenLogprobs, device: torch.device | str = "cpu") -> Importance:
    """The mean over the chunk's tokens of −log p(token | every token before it), from one forward: a
    rate, not a sum, so that a chunk already refilled to its facts weighs what it weighed whole (a
    sum would make it 1/7 of a fresh turn, and the proportional rule would then drop it)."""

    def score(chunks: list[Chunk], masked: list[int]) -> list[float]:
        ids = torch.tensor([[t for c in chunks for t in c.tokens]], device=device)
        nll = torch.zeros(ids.shape[1], device=ids.device)  # [S]: the first token has nothing before it
        nll[1:] = -logprobs(ids)[0]
        bounds = torch.tensor([0] + [len(c.tokens) for c in chunks]).cumsum(0).tolist()
        return [float(nll[bounds[i] : bounds[i + 1]].mean()) if bounds[i + 1] > bounds[i] else 0.0 for i in masked]

    score.rows = lambda chunks, masked: [size(chunks)]
    return score


def policy_scores(logprobs: NextTokenLogprobs, pad_id: int = 0, device: torch.device | str = "cpu") -> Importance:
    """Leave-one-out: log p(latest turn | context) − log p(latest turn | context without chunk i)."""

    def variants(chunks: list[Chunk], masked: list[int]) -> list[list[int]]:
        target = chunks[-1].tokens
        kept = [chunks] + [[c for j, c in enumerate(chunks) if j != i] for i in masked]
        return [[t for c in v[:-1] for t in c.tokens] + target for v in kept]

    def score(chunks: list[Chunk], masked: list[int]) -> list[float]:
        target = chunks[-1].tokens
        rows = variants(chunks, masked)
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
        for k, r in enumerate(rows):  # right padding: causal, so the pads change nothing before them
            ids[k, : len(r)] = torch.tensor(r, device=device)
        logp = logprobs(ids)  # [V+1, T-1]: position t scores token t+1
        totals = []
        for k, r in enumerate(rows):
            start = len(r) - len(target)
            totals.append(float(logp[k, start - 1 : len(r) - 1].sum()))
        return [totals[0] - t for t in totals[1:]]

    score.rows = lambda chunks, masked: [len(r) for r in variants(chunks, masked)]
    return score


def attention_mass(model) -> Importance:
    """The attention the latest turn pays each masked chunk, read from every attention layer's
    q and k (a hook on its softmax step, `InnerAttention`) in one forward of the whole context."""

    def score(chunks: list[Chunk], masked: list[int]) -> list[float]:
        ids = torch.tensor([[t for c in chunks for t in c.tokens]], device=next(model.parameters()).device)
        turn = len(chunks[-1].tokens)
        mass = []  # per layer: [S] attention each key position gets from the latest turn's queries

        def capture(module, args, out):
            q, k, _, _, scale = args[:5]  # q [1, H, S, D], k [1, K, S, D]
            sinks = args[5] if len(args) > 5 else None  # gpt-oss: [H], in every row's denominator
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            s = q.shape[2]
            logits = (q[:, :, s - turn :].float() @ k.float().transpose(-1, -2)) * scale  # [1, H, turn, S]
            keys, queries = (
                torch.arange(s, device=q.device)[None, :],
                torch.arange(s - turn, s, device=q.device)[:, None],
            )
            seen = keys <= queries
            if module.window:  # gpt-oss's sliding-window layers
                seen = seen & (keys > queries - module.window)
            logits = logits.masked_fill(~seen, float("-inf"))
            if sinks is not None:
                sink = sinks.float()[None, :, None, None].expand(1, -1, turn, 1)
                probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
            else:
                probs = logits.softmax(dim=-1)
            mass.append(probs.mean(dim=1).sum(dim=1)[0])  # mean over heads, sum over the turn's queries

        hooks = [m.inner.register_forward_hook(capture) for m in model.modules() if hasattr(m, "inner")]
        try:
            with torch.no_grad():
                model(ids)
        finally:
            for h in hooks:
                h.remove()
        per_token = torch.stack(mass).mean(dim=0)  # [S], averaged over layers
        bounds = torch.tensor([0] + [len(c.tokens) for c in chunks]).cumsum(0).tolist()
        return [float(per_token[bounds[i] : bounds[i + 1]].sum()) for i in masked]

    score.rows = lambda chunks, masked: [size(chunks)]
    return score


class MemoryDiffusion:
    def __init__(
        self,
        engine,
        tokenizer,
        params,
        importance: Importance,
        allocate: str = "proportional",
        keep_recent: int = 1,
        floor: float = 0.0,
        forward_flops: Callable[[int], float] | None = None,
        min_refill: int = 0,
        refill_context: bool = False,
    ):
        if allocate not in RULES:
            raise ValueError(f"memory.allocate={allocate!r}; allowed: {', '.join(RULES)}")
        self.engine, self.tokenizer, self.params, self.importance = engine, tokenizer, params, importance
        self.allocate, self.keep_recent, self.floor = allocate, keep_recent, floor
        self.min_refill = min_refill  # no refill shorter than this (`allocate.at_least`)
        self.refill_context = refill_context  # refill prompts hold the context after their chunk
        self.forward_flops = forward_flops
        """FLOPs of one row through the model (`ModelFlops.forward`): the importance forwards are counted."""
        self.refills: list[Refill] = []  # sampled since the episode runner last took them
        self.scoring_flops = 0.0  # of the importance forwards since the episode runner last took them
        self.calls = 0

    def _text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def compress(self, chunks: list[Chunk], limit: int) -> list[Chunk]:
        """One episode's rewrite, its refills sampled in one call of its own."""
        steps = self.compressing(chunks, limit)
        try:
            requests = next(steps)
            self.calls += 1
            seed = None if self.params.seed is None else self.params.seed * 7919 + self.calls
            steps.send(sample_refills(self.engine, dataclasses.replace(self.params, seed=seed), requests))
        except StopIteration as done:
            return done.value
        raise RuntimeError("a Memory Diffusion rewrite asks for its refills once")

    def compressing(self, chunks: list[Chunk], limit: int):
        """`compress` as a generator: yields its refill requests (if any) once, takes the `Refill`s
        sampled for them, returns the chunks. The episode runner samples many episodes' at once."""
        head, keep = chunks[:1], min(self.keep_recent, len(chunks) - 1)
        while keep and size(head) + size(chunks[len(chunks) - keep :]) > limit:
            keep -= 1  # the latest turns alone overflow: they are masked and refilled too
        recent = chunks[len(chunks) - keep :] if keep else []
        masked = list(range(1, len(chunks) - len(recent)))
        room = limit - size(head) - size(recent)
        if room < 0 or not masked:  # the task alone overflows: nothing to refill, drop the oldest
            return Truncate().compress(chunks, limit)
        scores = self.importance(chunks, masked)
        rows = getattr(self.importance, "rows", None)
        if rows is not None and self.forward_flops is not None:
            self.scoring_flops += sum(self.forward_flops(n) for n in rows(chunks, masked))
        lengths = [len(chunks[i].tokens) for i in masked]
        rule = RULES[self.allocate]
        extra = (self.floor,) if self.allocate == "threshold" else ()
        budgets = at_least(lambda w: rule(w, lengths, room, *extra), scores, lengths, self.min_refill)
        task = [t for c in head for t in c.tokens]

        def after(i: int) -> list[int] | None:
            return [t for c in chunks[i + 1 :] for t in c.tokens] if self.refill_context else None

        requests = {
            i: RefillRequest(refill_prompt(task, chunks[i].tokens, b, self._text, after(i)), b)
            for i, n, b in zip(masked, lengths, budgets, strict=True)
            if 0 < b < n
        }
        refills = dict(zip(requests, (yield list(requests.values())), strict=True)) if requests else {}
        self.refills += refills.values()
        stop = set(self.params.stop_token_ids)
        kept = []
        for i, n, b in zip(masked, lengths, budgets, strict=True):
            if b >= n:
                kept.append(chunks[i])
            elif b > 0:  # the policy's rewrite, its stop token not kept
                kept.append(Chunk([t for t in refills[i].tokens if t not in stop], chunks[i].turn))
        return head + kept + recent
