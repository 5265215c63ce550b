"""The policy core's pieces shared by every face: the one adapter optimizer path (`optimizer`)."""

from .optimizer import StepOutcome, adamw, optimizer_step

__all__ = ["StepOutcome", "adamw", "optimizer_step"]
