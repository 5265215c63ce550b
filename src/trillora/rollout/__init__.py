"""Rollout engines behind one protocol: `generate`, `sync`, `close`."""

from .local import LocalEngine
from .openai import EngineError, OpenAIEngine
from .sampling import filter_logits, sample_next
from .types import Completion, RolloutEngine, SamplingParams


def __getattr__(name: str):
    if name == "VLLMEngine":  # imported on use: vllm is an optional extra
        from .vllm import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)


__all__ = [
    "Completion",
    "EngineError",
    "LocalEngine",
    "OpenAIEngine",
    "RolloutEngine",
    "SamplingParams",
    "VLLMEngine",
    "filter_logits",
    "sample_next",
]
