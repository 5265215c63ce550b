"""Which experts a model's routers choose, observed from outside the model.

Every MoE block calls its router (`gate`) once per forward on its flattened tokens; a forward
hook on the router sees the choice [T, K] and a pre-hook on the block the call's [B, S] shape.
The rollout engine records this for router replay (`SamplingParams.return_routing`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..models import MoE


def moe_blocks(model: nn.Module) -> list[tuple[str, MoE]]:
    """The model's MoE blocks in forward order (layer order), with their names."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Collect, per MoE block name, the expert indices [B, S, K] chosen in each forward call."""
    records: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, block in moe_blocks(model):
        calls = records.setdefault(name, [])
        shape: list[torch.Size] = []

        def remember_shape(module, args, shape=shape):
            shape[:] = [args[0].shape[:-1]]

        def record(module, args, output, calls=calls, shape=shape):
            calls.append(output[1].detach().view(*shape[0], -1))

        handles += [block.register_forward_pre_hook(remember_shape), block.gate.register_forward_hook(record)]
    try:
        yield records
    finally:
        for h in handles:
            h.remove()
