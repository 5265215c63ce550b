"""`Policy`: the model being trained in this process and the verbs its clients call.

    forward(rows)                  logprobs of the rows' next tokens, no autograd state
    forward_backward(rows, loss)   logprobs with gradients, `loss` of them, backward (accumulates)
    optim_step(max_norm)           the accumulated gradient synced, clipped, stepped (or dropped)
    state() / load(tensors)        the adapter and its AdamW as one rank's tensors (`train_state`)
    save(folder, meta)             the adapter and its AdamW whole, as one saved state on disk
    unsharded()                    the whole adapter gathered, what `publish` sends and exports read
    publish(engine)                the engine samples with the adapter as it is now
    sample(engine, work)           a phase of sampling with the policy: `work` on rank 0 calls the
                                   engine; under the lockstep engine every rank decodes its shard

It owns the base laid out over the `World`'s ranks (`parallelize`: tensor, expert, context and
pipeline parallelism, FSDP of the frozen weights; an identity in one process), the trained
parameters and their AdamW. What runs over which rows, and which loss, is the client's: `trillora
train`'s GRPO update (`trainer.update`) and the learner's rounds over recorded traces call these
verbs; the math is `trillora.rl`.
Shape legend: b rows, T tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .. import lora
from ..checkpoint.train_state import rank_tensors, restore_rank_tensors, write_state
from ..parallel.data_parallel import GradientSync
from .logprobs import next_token_logprobs_of, shared_prompt_logprobs, token_logprobs
from .optimizer import StepOutcome, optimizer_step
from .world import World


@dataclass(frozen=True)
class Rows:
    """Token rows for a verb: right-padded prompt + completion ids, and when consecutive rows share
    their prompt, what lets each group's prompt run once (`parallel.share_prompts`)."""

    ids: torch.Tensor  # [b, T]
    group: int = 0
    """Consecutive rows sharing one prompt (0: no sharing; every pass runs whole rows)."""
    prompt_lengths: torch.Tensor | None = None  # [b] tokens of each row's prompt (with `group`)
    completion_lengths: torch.Tensor | None = None  # [b] positions from the prompt's end to the last trained one

    def __len__(self) -> int:
        return self.ids.shape[0]

    def shared(self, idx: torch.Tensor) -> bool:
        """The rows `idx` are whole groups, so their prompts may each run once."""
        g = self.group
        return bool(g) and len(idx) % g == 0 and int(idx[0]) % g == 0


Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""loss(logp [m, T-1], entropy [m, T-1], idx [m]): some rows' share of the loss (`idx` into the rows)."""


class Policy:
    def __init__(
        self,
        model: nn.Module,
        world: World,
        named: dict[str, nn.Parameter],
        optimizer: torch.optim.Optimizer,
        full: nn.Module | None = None,
        sync: GradientSync | None = None,
    ):
        """`model`: laid out by `world` (`World.start`) with its adapter in use; `named`: the trained
        parameters by name (this rank's shards), `optimizer` their AdamW (`policy.adamw`); `full`:
        what `unsharded` fills, rank 0's whole copy of the adapter (the model itself in one process,
        None on the other ranks); `sync`: where the gradients live over the ranks when they are not
        the model's own adapter (a service's slot adapter: `World.gradient_sync`)."""
        self.model, self.world, self.named, self.opt, self.full = model, world, named, optimizer, full
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.sync = sync if sync is not None or world.size == 1 else world.par.grad_sync
        self.placement = None
        """A service's slot adapter: where its tensors live over the shards (`policy.shards.Placement`)."""

    @classmethod
    def of_adapter(cls, base, world: World, adapter) -> Policy:
        """A slot adapter on a service's resident base (`policy.adapters`: a Tinker client's, a
        learner's), its AdamW made, as a Policy: its gradients synced over the shards it lives on."""
        policy = cls(
            base.model,
            world,
            adapter.params,
            adapter.optimizer,
            sync=world.gradient_sync(adapter.params, base.placement),
        )
        policy.placement = base.placement
        return policy

    @property
    def pipeline(self):
        """The training schedule over pipeline stages (None without pp, and on a service's base)."""
        return self.world.par.pipeline if self.world.par is not None else None

    # --- passes ----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, rows: Rows, temperature: float = 1.0, adapter: bool = True, whole_rows: bool = False):
        """Per-token logprobs [b, T-1] of the next tokens, through the same layout as training (the
        pipeline's stages under pp); `adapter=False`: the base alone (a KL reference);
        `whole_rows`: no prompt sharing for this pass (router replay feeds whole rows)."""
        with contextlib.nullcontext() if adapter else lora.disable_adapter(self.model):
            if self.pipeline is not None:
                return self.pipeline.logprobs(rows.ids, temperature)[0]
            everything = torch.arange(len(rows), device=rows.ids.device)
            return self.from_last(self._logprobs(rows, everything, temperature, False, whole_rows)[0])

    def forward_backward(
        self,
        rows: Rows,
        loss: Loss,
        temperature: float = 1.0,
        micro_rows: int = 0,
        around: Callable[[torch.Tensor], contextlib.AbstractContextManager[bool]] | None = None,
    ) -> float:
        """Forward and backward of `rows` in micro-batches of `micro_rows` (0: all at once; under pp
        the pipeline's microbatches), gradients accumulated; the summed loss. `around(idx)`: a context
        for each micro-batch's forward and backward that says whether it must run whole rows (router
        replay hooks: checkpointed layers replay in backward too)."""
        if self.pipeline is not None:
            return float(self.pipeline.train_step(rows.ids, loss, temperature))
        total, stages = 0.0, self.world.stages
        if stages is not None:  # a pass's row chunks in flight (GPipe), as the service's passes have them
            stages.microbatches = self.world.dims.pp_microbatches or self.world.dims.pp
        for idx in torch.arange(len(rows), device=rows.ids.device).split(micro_rows or len(rows)):
            with around(idx) if around is not None else contextlib.nullcontext(False) as whole:
                logp, entropy = self._logprobs(rows, idx, temperature, True, whole)
                part = loss(logp, entropy, idx) if logp is not None else None  # a stage's: the last one's
                if stages is not None:
                    stages.backward(part)  # the loss's gradient crosses the stages from the last
                else:
                    part.backward()
            total = total + (part.detach() if part is not None else 0.0)
        return float(self.from_last(float(total)) if stages is not None else total)

    def from_last(self, obj):
        """What the last pipeline stage made (a pass's logprobs, a loss's metrics) on every stage."""
        if self.pipeline is not None:
            return self.pipeline.share_from_last(obj)
        return self.world.stages.from_last(obj) if self.world.stages is not None else obj

    def _logprobs(self, rows: Rows, idx: torch.Tensor, temperature: float, with_entropy: bool, whole_rows: bool):
        """Logprobs (and entropies) [m, T-1] of rows `idx`; each group's prompt runs once when they are
        whole groups. On a service's pipeline stage: the last stage's, (None, None) before it."""
        if self.world.stages is not None:
            logits = self.model(rows.ids[idx])  # [m, T, V] on the last stage, None elsewhere
            if logits is None:
                return None, None
            return next_token_logprobs_of(self.model, logits, rows.ids[idx], temperature, with_entropy)
        if not whole_rows and rows.shared(idx):
            return shared_prompt_logprobs(
                self.model,
                rows.ids[idx],
                rows.prompt_lengths[idx],
                rows.completion_lengths[idx],
                rows.group,
                temperature,
                with_entropy,
            )
        return token_logprobs(self.model, rows.ids[idx], temperature, with_entropy=with_entropy)

    # --- the optimizer ---------------------------------------------------------------------
    def optim_step(self, max_norm: float = 0.0) -> tuple[StepOutcome, dict[str, float]]:
        """Sync, clip and apply the accumulated gradient (`policy.optimizer_step`): adapter gradients
        only, summed over data (and expert-data) ranks, the global norm equal on every rank; a
        non-finite one is dropped, so a NaN never reaches the adapter. Also the collective traffic."""
        out = optimizer_step(self.opt, self.params, self.sync, max_norm)
        counted = self.sync is not None and self.world.par is not None  # a replicated service lays nothing out
        return out, (self.world.par.traffic(out.sent_bytes) if counted else {})

    @property
    def steps(self) -> int:
        """AdamW steps taken (as its state counts them)."""
        return max((int(s["step"]) for s in self.opt.state.values() if "step" in s), default=0)

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    # --- state -----------------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """This rank's adapter (or weights) and AdamW state as one file's tensors."""
        return rank_tensors(self.named, self.opt)

    def load(self, tensors: dict[str, torch.Tensor], where, rng: bool = True) -> None:
        """`state()`'s tensors back in place; `where` names the file in errors; `rng`: the torch RNG
        too (this run's own state)."""
        restore_rank_tensors(tensors, self.named, self.opt, where, rng)

    def save(self, folder, meta: dict) -> None:
        """The adapter and its AdamW state whole, as one saved state (`train_state.write_state`, `meta`
        its `state_meta`): every rank joins the gather of a slot adapter's shards, rank 0 writes. A
        sharded run's own checkpoints stay per rank (`trainer.checkpoints`)."""
        tensors = self.state()
        if self.placement is not None:
            tensors = self.placement.full(tensors, self.world.device)
        elif self.world.size > 1:
            raise ValueError("a sharded run's adapter is saved per rank (trainer checkpoints), not whole")
        if self.world.main:
            write_state(folder, tensors, meta)

    def unsharded(self) -> nn.Module | None:
        """The whole model with the current adapter (`World.unsharded`): every rank joins; rank 0
        gets it, the others None."""
        return self.world.unsharded(self.model, self.full)

    def publish(self, engine) -> dict[str, float]:
        """Bring `engine` up to date with the adapter (every rank joins the gather; rank 0 syncs). The
        lockstep engine samples with the trained weights themselves: only its kept keys go."""
        if getattr(engine, "in_place", False):
            return engine.sync()
        full = self.unsharded()
        return engine.sync(full) if self.world.main else {}

    def sample(self, engine, work):
        """A phase of sampling with the policy as `publish` left `engine`: `work()` runs on rank 0 (its
        rollouts or evaluation: several `engine.generate` calls, multi-turn envs among them) and is
        returned there. Under torchrun the lockstep engine (`policy.decoding`) samples with the
        policy's own shards, so the other ranks decode theirs for each of rank 0's calls meanwhile
        (None there); with any other engine they wait."""
        if not getattr(engine, "in_place", False):
            return work() if self.world.main else None
        if not self.world.main:
            return engine.follow()
        try:
            return work()
        finally:
            engine.release()
