"""Rollout engines behind one protocol: `generate`, `sync`, `close`."""

from .local import LocalEngine
from .openai import EngineError, OpenAIEngine
from .sampling import filter_logits, sample_next
from .types import Completion, RolloutEngine, SamplingParams

__all__ = ["Completion", "EngineError", "LocalEngine", "OpenAIEngine", "RolloutEngine", "SamplingParams", "filter_logits", "sample_next"]
