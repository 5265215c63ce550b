"""Sampling a sharded policy in lock step: the one protocol by which every rank decodes its shard.

No rank holds the whole policy under torchrun, so a `generate` runs on every rank:

- the drivers, data-parallel rank 0's tp / cp / pp ranks, run the same `generate`: the same logits
  after tp's all-reduces and the last stage's broadcast, the same seeded generator, so the same
  tokens. Context parallelism is off meanwhile (each cp rank runs whole rows) and a
  vocabulary-parallel head's slices are gathered;
- before each forward of the drivers rank 0 announces what it needs (`say()`: the adapters it
  applies), and every other rank runs one token through its shard with it (`hear`), so that FSDP's
  gathers and the expert all-to-alls pair up; None ends the call.

`Lockstep` is that protocol, for both of its users: `trillora train`'s engine under torchrun
(`LockstepEngine`: rank 0's `LocalEngine` calls reach every rank as typed commands, `Generate` and
`Forget`, until `release()`), and a sharded service's sampling (`serve.sampling`). Nothing is
copied: the policy samples with its own weights, adapters unmerged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..parallel.vocab_parallel import gather_vocab
from ..rollout.local import LocalEngine
from ..rollout.types import SamplingParams
from .world import World, from_rank0


class Lockstep:
    def __init__(self, module: nn.Module, world: World, context, head: nn.Module | None, say: Callable, hear: Callable):
        """`module`: what the drivers' decoder calls once per forward; `context`: the context-parallel
        wrapper to switch off (or None); `head`: a vocabulary-parallel head this rank runs (or None);
        `say()`: rank 0's payload before a forward; `hear(payload)`: a follower's forward with it."""
        self.module, self.world, self.context, self.head, self.say, self.hear = module, world, context, head, say, hear
        self.driver = world.dp_rank == 0

    def drive(self, work):
        """The drivers: `work()` (their `generate`), each forward announced; then the followers are let go."""
        hook = self.module.register_forward_pre_hook(self._announce, prepend=True)  # before FSDP's gathers
        try:
            with self.decoding():
                return work()
        finally:
            hook.remove()
            from_rank0(None)

    def _announce(self, module, args) -> None:
        from_rank0(self.say())  # a pre-hook's return value would replace the forward's arguments

    def follow(self) -> None:
        """The other ranks: one forward per announcement, until the drivers' call ends."""
        with self.decoding(), torch.no_grad():
            while (payload := from_rank0(None)) is not None:
                self.hear(payload)

    @contextlib.contextmanager
    def decoding(self):
        """Whole rows and whole logits on every rank: context parallelism off (each cp rank runs the
        same tokens), a vocabulary-parallel head's slices gathered over tp, and on a service's
        pipeline stages the last stage's logits shared with every stage."""
        with contextlib.ExitStack() as stack:
            if self.context is not None:
                stack.enter_context(self.context.off())
            if self.head is not None:
                group = self.world.group("tp")
                hook = self.head.register_forward_hook(lambda m, args, out: gather_vocab(out, group))
                stack.callback(hook.remove)
            if self.world.stages is not None:
                stack.enter_context(self.world.stages.sharing_logits())
            yield


@dataclass(frozen=True)
class Generate:
    prompts: list[list[int]]
    n: int
    params: SamplingParams


@dataclass(frozen=True)
class Forget:
    """Drop the kept keys and values (the drivers' engines keep the same ones)."""


class LockstepEngine:
    """Rank 0's `LocalEngine` calls, run by every rank of `trillora train`'s sharded policy."""

    returns_routing = True
    in_place = True  # it samples with the trained weights themselves (`Policy.publish`)
    model = None  # no rank may run the policy alone (memory scoring asks for it: refused by name)

    def __init__(self, model: nn.Module, world: World, pad_id: int):
        """`model`: this rank's shard of the policy, laid out by `world` (`World.start`)."""
        par, self.device = world.par, world.device
        decoder = par.pipeline.decoder(model) if par.pipeline is not None else model
        head = decoder.lm_head if world.dims.vocab_parallel and par.pipeline is None else None
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.lockstep = Lockstep(decoder, world, par.context, head, say=lambda: True, hear=lambda _: decoder(ids))
        driver = self.lockstep.driver
        self.engine = LocalEngine(decoder, precision="policy", device=self.device, pad_id=pad_id) if driver else None

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
        return self._run(from_rank0(Generate(prompts, n, params)))

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
            else:
                self._run(command)

    def _run(self, command: Generate):
        if not self.lockstep.driver:
            return self.lockstep.follow()
        return self.lockstep.drive(lambda: self.engine.generate(command.prompts, command.n, command.params))
