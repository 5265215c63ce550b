"""The policy core's pieces shared by every face: the one adapter optimizer path (`optimizer`) and
the one place logprobs are read off the head (`logprobs`)."""

from .optimizer import StepOutcome, adamw, optimizer_step

__all__ = ["StepOutcome", "adamw", "optimizer_step"]
