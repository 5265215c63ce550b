"""Data parallelism for the adapters: only LoRA gradients cross ranks, and we count the bytes.

The frozen base is never reduced (it has no gradients). Dense adapters are summed over
the data-parallel group; routed-expert adapters over the expert-data-parallel group (the
replicas of the same expert shard), since expert parallelism already brought every token
routed to a rank's experts to that rank. Losses are normalised by global token counts
(`rl.aggregation`), so the sum over ranks is the full-batch gradient.

Under tensor parallel, an adapter matrix that is replicated across tp (A of a column-parallel
layer, B of a row-parallel one) gets a partial gradient on each tp rank (DTensor marks it
`Partial`): it is reduced over tp first, to the parameter's own placement.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..lora.apply import lora_parameters
from ..models.moe import GroupedExperts


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def expert_parameter_names(model: nn.Module) -> set[str]:
    return {f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, GroupedExperts)
            for p, _ in m.named_parameters(recurse=False)}


class GradientSync:
    """All-reduce (sum) of LoRA gradients, bucketed per group; `bytes_per_step` is what this
    rank sends into the collectives (the local gradient bytes)."""

    def __init__(self, model: nn.Module, dp_group, edp_group, dp_size: int, edp_size: int):
        experts = expert_parameter_names(model)
        self.dense = [p for n, p in lora_parameters(model) if n not in experts]
        self.experts = [p for n, p in lora_parameters(model) if n in experts]
        self.groups = [(self.dense, dp_group, dp_size), (self.experts, edp_group, edp_size)]
        self.bytes_per_step = sum(local_tensor(p).numel() * local_tensor(p).element_size()
                                  for params, _, size in self.groups if size > 1 for p in params)

    @torch.no_grad()
    def __call__(self) -> int:
        sent = 0
        for p in self.dense:
            if p.grad is not None and hasattr(p.grad, "placements") and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)  # Partial -> Replicate: all-reduce over tp
        for params, group, size in self.groups:
            grads = [local_tensor(p.grad) for p in params if p.grad is not None]
            if size == 1 or not grads:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])  # one collective per group
            dist.all_reduce(flat, group=group)
            sent += flat.numel() * flat.element_size()
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        return sent
