"""Data parallelism for the adapters: only LoRA gradients cross ranks, and we count the bytes.

The frozen base is never reduced (it has no gradients). Dense adapters are summed over
the data-parallel group; routed-expert adapters over the expert-data-parallel group (the
replicas of the same expert shard), since expert parallelism already brought every token
routed to a rank's experts to that rank. Losses are normalised by global token counts
(`rl.aggregation`), so the sum over ranks is the full-batch gradient.

Under tensor parallel, an adapter matrix that is replicated across tp (A of a column-parallel
layer, B of a row-parallel one) gets a partial gradient on each tp rank (DTensor marks it
`Partial`): it is reduced over tp first, to the parameter's own placement.

`GradientSync.norm` is the clipping norm over all of it: each shard's squares counted once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..models.layers import local
from ..models.moe import GroupedExperts


def sharded_dims(t: torch.Tensor) -> list[int]:
    """The mesh dimensions a DTensor is split over. FSDP over a tensor-parallel parameter shards
    an already sharded dim and marks it `_StridedShard`, which is not `is_shard()`: anything
    that is neither replicated nor a pending sum holds a part of the tensor."""
    if not hasattr(t, "placements"):
        return []
    return [i for i, pl in enumerate(t.placements) if not (pl.is_replicate() or pl.is_partial())]


def expert_parameter_names(model: nn.Module) -> set[str]:
    return {
        f"{name}.{p}"
        for name, m in model.named_modules()
        if isinstance(m, GroupedExperts)
        for p, _ in m.named_parameters(recurse=False)
    }


class GradientSync:
    """Where an adapter's gradients live over the ranks, and the two things done with them before a
    step: the all-reduce (sum) of the gradients, bucketed per group, and the global norm.
    `named`: the adapter's (name, parameter) pairs; `experts`: the names of routed-expert slices.
    `bytes_per_step` is what this rank sends into the sum (the local gradient bytes)."""

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        experts: set[str],
        dp_group,
        edp_group,
        dp_size: int,
        edp_size: int,
        ep_group=None,
        pp_group=None,
    ):
        self.named, self.experts = named, experts
        self.dense = [p for n, p in named if n not in experts]
        self.expert_params = [p for n, p in named if n in experts]
        self.groups = [(self.dense, dp_group, dp_size), (self.expert_params, edp_group, edp_size)]
        self.ep_group, self.pp_group = ep_group, pp_group
        """Other ranks hold other expert slices (ep) or other layers (pp): the norm sums over them."""
        self.bytes_per_step = sum(
            local(p).numel() * local(p).element_size() for params, _, size in self.groups if size > 1 for p in params
        )

    @torch.no_grad()
    def __call__(self) -> int:
        sent = 0
        for p in self.dense:
            if p.grad is not None and hasattr(p.grad, "placements") and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)  # Partial -> Replicate: all-reduce over tp
        for params, group, size in self.groups:
            grads = [local(p.grad) for p in params if p.grad is not None]
            if size == 1 or not grads:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])  # one collective per group
            dist.all_reduce(flat, group=group)
            sent += flat.numel() * flat.element_size()
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        return sent

    @torch.no_grad()
    def norm(self) -> torch.Tensor:
        """The L2 norm of the whole adapter's gradient, equal on every rank (call after the sum):
        squares summed locally, then over every mesh axis a gradient is split on (tp, FSDP's dp × cp),
        over ep for expert slices, and over the pipeline stages."""
        buckets: dict[tuple, list] = {}  # mesh axis names -> [sum of squares, groups]
        for name, p in self.named:
            if p.grad is None:
                continue
            g = p.grad
            names, groups = [], []
            for i in sharded_dims(g):
                mesh = g.device_mesh
                names.append(mesh.mesh_dim_names[i] if mesh.mesh_dim_names else str(i))
                groups.append(mesh.get_group(i))
            if name in self.experts and self.ep_group is not None:
                names.append("ep")
                groups.append(self.ep_group)
            bucket = buckets.setdefault(tuple(names), [torch.zeros((), dtype=torch.float64), groups])
            bucket[0] += local(g).double().square().sum()
        total = torch.zeros((), dtype=torch.float64)
        for key in sorted(buckets):  # names are the same on every rank of a stage, so the collectives line up
            sq, groups = buckets[key]
            for group in groups:
                dist.all_reduce(sq, group=group)
            total += sq
        if self.pp_group is not None:  # each pipeline rank holds other layers' adapters
            dist.all_reduce(total, group=self.pp_group)
        return total.sqrt().float()
