"""Sampling on the resident base, for the service's `sample_many`: the calls that wait together
share one `generate` (per samples-per-prompt `n`), each row with its own revision (`lora.multi`)
and its own settings and seed (`rollout.sampling.RowSettings`: a seeded call gives the same tokens
alone or beside others); a call asking for prompt logprobs or top-k scores runs alone. One group's
failure is its own calls' outcome. On a sharded base (`policy.world`) every rank samples
in lock step (`policy.decoding.Lockstep`): dp rank 0's tp / cp / pp group drives the same
`generate`, and before each forward rank 0 names the revision(s) in use, so that the other ranks
run one token through the same ones and their experts serve the drivers' rows."""

from __future__ import annotations

import secrets
from collections.abc import Callable

import numpy as np
import torch

from ..models.transformer import OtherStage
from ..policy.adapters import ResidentBase, Revision
from ..policy.decoding import Lockstep
from ..policy.logprobs import score_prompt, topk_sampled
from ..policy.world import World
from ..rollout.local import LocalEngine
from .calls import BadRequest, SampleCall, cut_at_stop


class Sampling:
    def __init__(
        self,
        base: ResidentBase,
        engine: LocalEngine,
        ranks: World,
        tokenizer,
        device: torch.device,
        check: Callable,
        lookup: Callable[[str], Revision],
    ):
        """`check(call)`: (revision, SamplingParams, stop strings), or BadRequest; `lookup(sampler_id)`: a revision."""
        self.base, self.engine, self.ranks, self.tokenizer, self.device = base, engine, ranks, tokenizer, device
        self.check, self.lookup = check, lookup
        model = base.model
        head = model.lm_head if ranks.dims.vocab_parallel and not isinstance(model.lm_head, OtherStage) else None
        context = getattr(model, "context_parallel", None)
        self.lockstep = Lockstep(model, ranks, context, head, say=self._in_use, hear=self._one_token)

    def run(self, calls: list[SampleCall]) -> list:
        if not self.ranks.sharded:
            return self._groups(calls)
        if self.lockstep.driver:
            return self.lockstep.drive(lambda: self._groups(calls))
        self.lockstep.follow()
        return []

    def _groups(self, calls: list[SampleCall]) -> list:
        outcomes: list = [None] * len(calls)
        groups: dict = {}
        for i, c in enumerate(calls):
            try:
                revision, sp, stops = self.check(c)
            except BadRequest as e:
                outcomes[i] = e
                continue
            key = ("alone", i) if c.prompt_logprobs or c.options else c.n
            groups.setdefault(key, []).append((i, c, revision, sp, stops))
        for group in groups.values():
            revisions = list({id(r): r for _, _, r, _, _ in group}.values())
            group.sort(key=lambda g: [id(r) for r in revisions].index(id(g[2])))  # each revision's rows together
            rows = [sum(g[2] is r for g in group) for r in revisions]
            try:
                self._generate(group, revisions, rows, outcomes)
            except Exception as e:  # noqa: BLE001 - this group's calls fail, the other groups' stand
                for i, *_ in group:
                    outcomes[i] = e
        return outcomes

    def _generate(self, group: list, revisions: list[Revision], rows: list[int], outcomes: list) -> None:
        """One `generate` for a group of calls with the same settings, each row with its revision."""
        _, c, _, sp, _ = group[0]
        use = self.base.use(revisions[0]) if len(revisions) == 1 else self.base.use_many(revisions, rows)
        # one setting for all, unseeded: the trainer's decode, draw for draw; else each call its own
        each = None if sp.seed is None and all(g[3] == sp for g in group) else [g[3] for g in group]
        with use as model, torch.no_grad():  # a chat's next call continues its last one's keys and values
            out = self.engine.generate([g[1].prompt for g in group], c.n, sp, each=each, weights=[g[2] for g in group])
            for (i, call, _, sp, stops), completions in zip(group, out, strict=True):
                sequences = [cut_at_stop(x, stops, self.tokenizer) for x in completions]
                extras = self._scores(model, call, sequences, sp) if call.prompt_logprobs or call.options else {}
                outcomes[i] = (sequences, extras.pop("prompt_logprobs", None), extras)

    def _scores(self, model, call: SampleCall, sequences: list, sp) -> dict:
        """A call of its own group: what it asked beyond the tokens (`policy.logprobs.score_prompt`)."""
        o = call.options
        out = {}
        if call.prompt_logprobs or set(o) - {"topk_sample_logprobs"}:
            logits = model(torch.tensor([call.prompt], device=self.device))[0]  # [N, V]
            generator = torch.Generator(device=self.device)
            generator.manual_seed(sp.seed if sp.seed is not None else secrets.randbits(62))
            out = score_prompt(logits, call.prompt, o, call.prompt_logprobs, sp.temperature, generator)
        if k := o.get("topk_sample_logprobs"):
            out["topk_sample"] = []
            for tokens, *_ in sequences:
                if not tokens:
                    out["topk_sample"].append((np.zeros((0, k), np.int32), np.zeros((0, k), np.float32)))
                    continue
                logits = model(torch.tensor([call.prompt + tokens[:-1]], device=self.device))[0]  # [N + L - 1, V]
                out["topk_sample"].append(topk_sampled(logits, len(call.prompt), tokens, k, sp.temperature))
        return out

    def _in_use(self) -> str | list[str]:
        """Rank 0, before each forward: the sampler id(s) of the revision(s) in the slots."""
        in_use = self.base.in_use
        return [r.sampler_id for r in in_use] if isinstance(in_use, tuple) else in_use.sampler_id

    def _one_token(self, named: str | list[str]) -> None:
        """A follower: one token through the revision(s) rank 0 named, numbered alike."""
        if isinstance(named, list):
            revisions = [self.lookup(n) for n in named]
            use = self.base.use_many(revisions, [1] + [0] * (len(revisions) - 1))
        else:
            use = self.base.use(self.lookup(named))
        with use as model:
            model(torch.zeros(1, 1, dtype=torch.long, device=self.device))
