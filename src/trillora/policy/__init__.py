"""The policy core every face is a client of: `Policy` (`policy`: a laid-out model, its trained
adapter and AdamW, and the verbs), the ranks it runs on (`world.World`), one resident base with
adapter slots and the adapters and revisions that use them (`adapters`, built by `resident`, placed
on a sharded base by `shards`), the one adapter optimizer path (`optimizer`) and the one place
logprobs are read off the head (`logprobs`)."""

from .optimizer import StepOutcome, adamw, optimizer_step

__all__ = ["StepOutcome", "adamw", "optimizer_step"]
