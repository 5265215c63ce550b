"""The context of long multi-turn episodes kept under a token budget (`context`; the run's
`[memory]` section): by truncation, a summary, recall, or Memory Diffusion (`diffusion`: mask ->
allocate -> refill). Named `context`, not `memory`, so that it is not read as GPU memory."""

from .allocate import RULES
from .context import Chunk, MemoryContext, MemoryPolicy, Truncate, split_spans, word_cuts
from .diffusion import (
    MemoryDiffusion,
    Refill,
    RefillRequest,
    attention_mass,
    policy_scores,
    recency,
    refill_prompt,
    sample_refills,
    surprise,
)
from .retrieval import Recall, bm25
from .summary import Summarize

__all__ = [
    "RULES",
    "Chunk",
    "MemoryContext",
    "MemoryDiffusion",
    "MemoryPolicy",
    "Recall",
    "Refill",
    "RefillRequest",
    "Summarize",
    "Truncate",
    "attention_mass",
    "policy_scores",
    "recency",
    "refill_prompt",
    "sample_refills",
    "surprise",
    "bm25",
    "split_spans",
    "word_cuts",
]
