"""Sampling with the sharded policy itself under torchrun: every rank decodes its part in lock step.

`trillora train` samples on rank 0, where its tasks, envs and rewards live. Under torchrun no rank
holds the whole policy, so rank 0's engine calls reach every rank as typed commands (`Generate`,
`Forget`; `None` ends a phase of sampling, `release()`), and the other ranks serve them in
`follow()`:

- the drivers, data-parallel rank 0's tp / cp / pp ranks, run the same `generate`: the same logits
  after tp's all-reduces and the last stage's broadcast, the same seeded generator, so the same
  tokens. Context parallelism is off meanwhile (each cp rank runs whole rows) and a
  vocabulary-parallel head's slices are gathered;
- every other rank runs one token through its shard for each forward of the drivers (rank 0
  announces each), so that FSDP's gathers and the expert all-to-alls pair up.

Nothing is copied: the engine samples with the policy's own weights, adapters unmerged, as
`serve.sampling` does for a sharded service.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from ..parallel.vocab_parallel import gather_vocab
from ..rollout.local import LocalEngine
from ..rollout.types import SamplingParams
from .world import from_rank0


@dataclass(frozen=True)
class Generate:
    prompts: list[list[int]]
    n: int
    params: SamplingParams


@dataclass(frozen=True)
class Forget:
    """Drop the kept keys and values (the drivers' engines keep the same ones)."""


class LockstepEngine:
    """Rank 0's `LocalEngine` calls, run by every rank of a sharded policy."""

    returns_routing = True
    in_place = True  # it samples with the trained weights themselves (`Policy.publish`)
    model = None  # no rank may run the policy alone (memory scoring asks for it: refused by name)

    def __init__(self, model: nn.Module, par, rank: int, device: torch.device, pad_id: int):
        """`model`: this rank's shard of the policy; `par`: its `parallel.Parallelized` layout."""
        self.par, self.rank, self.device = par, rank, device
        self.driver = par.meshes.rank("dp") == 0
        decoder = par.pipeline.decoder(model) if par.pipeline is not None else model
        self.forward = decoder  # what the followers run their token through
        self.engine = (
            LocalEngine(_Announcing(decoder, self._announce), precision="policy", device=device, pad_id=pad_id)
            if self.driver
            else None
        )

    @property
    def reused_tokens(self) -> int:
        return self.engine.reused_tokens

    def pinned(self) -> None:
        return None

    def sync(self, model=None) -> dict[str, float]:
        """Every rank: the adapters trained in place, so only the kept keys and values are stale."""
        if self.engine is not None:
            self.engine.forget()
        return {"sync_bytes": 0.0, "sync_seconds": 0.0}

    # --- rank 0 -------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams):
        command = from_rank0(Generate(prompts, n, params))
        return self._run(command)

    def forget(self) -> None:
        from_rank0(Forget())
        self.engine.forget()

    def release(self) -> None:
        """The end of rank 0's phase of sampling: the other ranks leave `follow()`."""
        from_rank0(None)

    def close(self) -> None:
        self.engine = None

    # --- every rank ---------------------------------------------------------------------------
    def follow(self) -> None:
        """The other ranks: serve rank 0's commands until it releases them."""
        while (command := from_rank0(None)) is not None:
            if isinstance(command, Forget):
                if self.engine is not None:
                    self.engine.forget()
            elif self.driver:
                self._run(command)
            else:
                self._follow_forwards()

    def _run(self, command: Generate):
        with self._decoding():
            try:
                return self.engine.generate(command.prompts, command.n, command.params)
            finally:
                self._announce(False)  # the followers leave `follow_forwards`

    def _follow_forwards(self) -> None:
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        with self._decoding(), torch.no_grad():
            follow_forwards(lambda _: self.forward(ids))

    def _decoding(self):
        head = self.forward.lm_head if self.par.dims.vocab_parallel and self.par.pipeline is None else None
        return whole_rows(self.par.context, head, self.par.meshes.group("tp"))

    def _announce(self, forward: bool) -> None:
        """Rank 0 says a forward follows (True) or the call ended (None); every rank hears it. The
        drivers' announcements are rank 0's too: each runs the same forwards."""
        from_rank0(True if forward else None)


def follow_forwards(run) -> None:
    """A rank that holds no rows of the drivers' call: `run(payload)` once per forward rank 0
    announces (its payload: what that forward needs, e.g. the adapters it applies), until None."""
    while (payload := from_rank0(None)) is not None:
        run(payload)


@contextlib.contextmanager
def whole_rows(context, head: nn.Module | None, vocab_group):
    """Whole rows and whole logits on every rank that decodes: context parallelism off (each cp rank
    runs the same tokens) and, with `head` (a vocabulary-parallel head this rank runs), its slices
    gathered over tp."""
    with contextlib.ExitStack() as stack:
        if context is not None:
            stack.enter_context(context.off())
        if head is not None:
            hook = head.register_forward_hook(lambda m, args, out: gather_vocab(out, vocab_group))
            stack.callback(hook.remove)
        yield


class _Announcing(nn.Module):
    """The decoder, announcing each forward to the ranks that follow."""

    def __init__(self, decoder: nn.Module, announce):
        super().__init__()
        self.decoder, self.announce = decoder, announce
        self.model, self.args = decoder.model, decoder.args  # the engine sizes its cache by model.layers

    def forward(self, *args, **kwargs):
        self.announce(True)
        return self.decoder(*args, **kwargs)
