"""Tensor parallelism as plans over module names, applied from outside with `parallelize_module`.

Column-parallel layers split their output features, row-parallel ones their input
features (Megatron's pairing: one all-reduce per attention block and per MLP). A LoRA
adapter follows its base layer so its math stays local: column-parallel W [O/tp, I] gets
A [r, I] replicated and B [O/tp, r] split; row-parallel W [O, I/tp] gets A [r, I/tp] split
and B [O, r] replicated, whose partial output joins the base's partial sum in the same
all-reduce. Attention splits heads (q/k/v and MLA's up-projections column-wise, o_proj
row-wise); MLA's small down-projections (q_a_proj, kv_a_proj_with_mqa) stay replicated.
Routers, routed experts (see expert_parallel), norms, embeddings and the head are replicated.

One MLA detail: the rope part of kv_a_proj_with_mqa's output (k_rope, one head shared by all
heads) is used by every rank's local heads outside any DTensor op, so its gradient is a
partial sum over tp; a hook on that layer all-reduces exactly those columns of the gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..models.attention import GQAttention, MLAttention
from ..models.layers import SwiGLU


def _distribute(module: nn.Module, mesh, placements: dict[str, list]) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        place = placements.get(name, [Replicate()])
        module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, place), requires_grad=param.requires_grad))


class LoraColwiseParallel(ColwiseParallel):
    """ColwiseParallel that also places the adapter: A replicated, B split by output row."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _distribute(module, device_mesh, {"weight": [Shard(0)], "bias": [Shard(0)], "lora_B": [Shard(0)]})


class LoraRowwiseParallel(RowwiseParallel):
    """RowwiseParallel that also places the adapter: A split by input column, B replicated."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _distribute(module, device_mesh, {"weight": [Shard(1)], "lora_A": [Shard(1)]})


class _AllReduceGradColumns(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient's columns [start:] over the group."""

    @staticmethod
    def forward(ctx, x, start: int, group):
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        part = grad[..., ctx.start:].contiguous()
        dist.all_reduce(part, group=ctx.group)
        grad[..., ctx.start:] = part
        return grad, None, None


def _share_k_rope(attn: MLAttention, group) -> None:
    attn.kv_a_proj_with_mqa.register_forward_hook(
        lambda mod, args, out: _AllReduceGradColumns.apply(out, attn.latent, group))


def tp_plan(model: nn.Module) -> dict[str, object]:
    """{module name: style} for every layer the family splits."""
    plan: dict[str, object] = {}
    for name, m in model.named_modules():
        if isinstance(m, GQAttention):
            for proj in ("q_proj", "k_proj", "v_proj"):
                plan[f"{name}.{proj}"] = LoraColwiseParallel()
            plan[f"{name}.o_proj"] = LoraRowwiseParallel()
        elif isinstance(m, MLAttention):
            plan[f"{name}.{'q_proj' if hasattr(m, 'q_proj') else 'q_b_proj'}"] = LoraColwiseParallel()
            plan[f"{name}.kv_b_proj"] = LoraColwiseParallel()
            plan[f"{name}.o_proj"] = LoraRowwiseParallel()
        elif isinstance(m, SwiGLU):  # dense MLP and shared experts
            plan[f"{name}.gate_proj"] = LoraColwiseParallel()
            plan[f"{name}.up_proj"] = LoraColwiseParallel()
            plan[f"{name}.down_proj"] = LoraRowwiseParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> dict[str, object]:
    plan = tp_plan(model)
    if tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, plan)
        for m in model.modules():
            if isinstance(m, MLAttention):
                _share_k_rope(m, tp_mesh.get_group())
    return plan
