"""Memory for long multi-turn episodes: the context kept under a token budget (`context`)."""

from .context import Chunk, MemoryContext, MemoryPolicy, Truncate, split_spans

POLICIES = {"truncate": Truncate}

__all__ = ["POLICIES", "Chunk", "MemoryContext", "MemoryPolicy", "Truncate", "split_spans"]
