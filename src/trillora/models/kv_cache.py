"""Key/value cache for incremental decoding: preallocated per layer, written in place.

MLA layers cache their expanded keys and values (not the compressed latent): simpler,
and the models this engine serves are small; the big ones roll out on vLLM.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, max_len: int):
        self.max_len = max_len
        self.length = 0  # tokens already in the cache (all layers)
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k [B, K, t, D] and v [B, K, t, V] at the current length; return everything so far."""
        t = k.shape[2]
        end = self.length + t
        if end > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} tokens is full (needs {end})")
        if self.k[layer] is None:
            b, heads = k.shape[:2]
            self.k[layer] = k.new_empty(b, heads, self.max_len, k.shape[-1])
            self.v[layer] = v.new_empty(b, v.shape[1], self.max_len, v.shape[-1])
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, t: int) -> None:
        self.length += t

    def select(self, rows: torch.Tensor) -> None:
        """Keep these rows [B'] (with repeats: a prompt prefilled once for several requests)."""
        self.k = [None if k is None else k[rows] for k in self.k]
        self.v = [None if v is None else v[rows] for v in self.v]

    def expand(self, n: int) -> None:
        """Each row becomes n consecutive rows (a prompt prefilled once, then sampled n times)."""
        if n > 1:
            self.k = [None if k is None else k.repeat_interleave(n, 0) for k in self.k]
            self.v = [None if v is None else v.repeat_interleave(n, 0) for v in self.v]


class SharedPrefixCache:
    """Each group's prompt computed once and shown to all G of its completions, with autograd.

    GRPO samples G completions per prompt, so a training forward over whole rows runs every
    prompt G times. The first call (the P distinct prompts) keeps its keys and values; the
    second (the B = P·G completions) attends to its group's prompt keys followed by its own.
    Nothing is written in place, so gradients flow back into the one prompt pass.
    """

    def __init__(self, group_size: int):
        self.group_size = group_size
        self.length = 0
        self.prompts: int | None = None  # P, from the first call
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the call is told by its rows, not by the order of calls: activation checkpointing recomputes
        # a prompt layer in backward, after the completions ran; the first keys stay the ones kept
        # (they are in the graph the completions' gradients flow through)
        if self.prompts is None or k.shape[0] == self.prompts:  # the prompts: k [P, K, Tp, D]
            self.prompts = k.shape[0]
            self.k.setdefault(layer, k)
            self.v.setdefault(layer, v)
            return k, v
        g = self.group_size  # the completions: k [P·G, K, Tc, D] after their prompt's [Tp]
        return (
            torch.cat([self.k[layer].repeat_interleave(g, 0), k], dim=2),
            torch.cat([self.v[layer].repeat_interleave(g, 0), v], dim=2),
        )

    def advance(self, t: int) -> None:
        self.length += t
