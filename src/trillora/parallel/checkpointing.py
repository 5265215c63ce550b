"""Activation checkpointing per decoder layer: keep a layer's input, recompute its inside in backward.

The layer's `forward` is replaced on the instance (names, hooks and plans stay as they are)
by a non-reentrant `torch.utils.checkpoint` of the original, so it composes with FSDP2 (the
unit's parameters are gathered again for the recompute), tensor parallel and expert
parallel (the all-to-alls run again in the recompute, in the same order on every rank).
RNG state is restored for the recompute, so dropout masks match.
"""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

from ..models.transformer import DecoderLayer


def apply_activation_checkpointing(model: nn.Module, every: int) -> list[int]:
    """Checkpoint every `every`-th decoder layer (1 = all, 0 = none); returns their indices."""
    if every < 0:
        raise ValueError(f"activation_checkpoint_every={every}; must be >= 0 (0 = off, 1 = every layer)")
    chosen = []
    if every == 0:
        return chosen
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    for i, layer in enumerate(layers):
        if i % every == 0:
            original = layer.forward

            def forward(*args, _original=original, **kwargs):
                return checkpoint(_original, *args, use_reentrant=False, **kwargs)

            layer.forward = forward
            chosen.append(i)
    return chosen
