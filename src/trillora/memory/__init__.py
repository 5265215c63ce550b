"""Memory for long multi-turn episodes: the context kept under a token budget (`context`), by
truncation or by Memory Diffusion (`diffusion`: mask -> allocate -> refill)."""

from .allocate import RULES
from .context import Chunk, MemoryContext, MemoryPolicy, Truncate, split_spans
from .diffusion import MemoryDiffusion, Refill, attention_mass, policy_scores, recency
from .retrieval import Recall, bm25
from .summary import Summarize

__all__ = ["RULES", "Chunk", "MemoryContext", "MemoryDiffusion", "MemoryPolicy", "Recall", "Refill", "Summarize", "Truncate", "attention_mass",
           "policy_scores",
           "recency", "bm25", "split_spans"]
