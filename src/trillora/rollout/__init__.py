"""Rollout engines behind one protocol: `generate`, `sync`, `close`."""

from .local import LocalEngine
from .sampling import filter_logits, sample_next
from .types import Completion, RolloutEngine, SamplingParams

__all__ = ["Completion", "LocalEngine", "RolloutEngine", "SamplingParams", "filter_logits", "sample_next"]
