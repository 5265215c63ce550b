"""The policy core's pieces shared by every face: one resident base with adapter slots and the
adapters and revisions that use them (`adapters`, placed on a sharded base by `shards`), the one
adapter optimizer path (`optimizer`) and the one place logprobs are read off the head (`logprobs`)."""

from .optimizer import StepOutcome, adamw, optimizer_step

__all__ = ["StepOutcome", "adamw", "optimizer_step"]
