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
