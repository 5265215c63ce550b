"""The resident base of a service: this rank's part of the model on its `World`, with adapter slots
(`policy.adapters.ResidentBase`) placed over the shards (`policy.shards`).

Replicated (one process, or data parallelism alone): the whole model on every rank; of the layout
only activation checkpointing applies. Sharded: built on the meta device, cut to this rank's
pipeline stage and experts, split over tp, and only then allocated and read, each rank reading its
own part of every tensor (`checkpoint.fill_model`); a given model (benchmarks of real shapes) is
split the same way after the fact.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import fill_model, load_model, meta_model
from ..parallel.checkpointing import apply_activation_checkpointing
from ..parallel.parallelize import parallelize
from ..parallel.pipeline import split_layers
from ..parallel.staged import StagedModel
from .adapters import ResidentBase
from .shards import ExpertShard, TensorShard
from .world import World


def resident_base(
    world: World,
    path: Path,
    dtype: torch.dtype,
    args,
    layout,
    alpha: float,
    precision: str = "fp32",
    model=None,
) -> ResidentBase:
    """This rank's part of the base at `path` (or `model`; `args` its architecture), with
    `layout`'s activation checkpointing (a `ParallelDims`; the degrees are `world.dims`'); sets
    `world.par` and `world.stages`. `precision="bf16_weights"`: the base's weights rounded to bf16 (bf16 numerics at
    fp32 speed on a CPU)."""
    base = _build(world, path, dtype, args, layout, alpha, model)
    if precision == "bf16_weights":
        with torch.no_grad():
            for name, p in base.model.named_parameters():
                if ".lora_" not in name and p.is_floating_point():
                    p.copy_(p.to(torch.bfloat16))
    return base


def _build(world: World, path: Path, dtype: torch.dtype, args, layout, alpha: float, model=None) -> ResidentBase:
    dims, meshes, device = world.dims, world.meshes, world.device
    if not world.sharded:  # the base whole on every rank: of the layout, only activation checkpointing applies
        model = model if model is not None else load_model(path, dtype=dtype, device=device)
        base = ResidentBase(model, alpha=alpha)
        apply_activation_checkpointing(model, layout.activation_checkpoint_every)
        return base
    experts = (meshes.rank("ep"), dims.ep) if dims.ep > 1 else None
    layers = split_layers(args.num_layers, dims.pp)[meshes.rank("pp")] if dims.pp > 1 else None
    on_meta = model is None
    if on_meta:
        model = meta_model(path, dtype, experts, layers)
    if dims.pp > 1:
        model = world.stages = StagedModel(model, meshes.group("pp"), meshes.rank("pp"), dims.pp)
        world.stages.chunk_group = meshes.group("ep") if dims.ep > 1 else None
    base = ResidentBase(model, alpha=alpha)
    # the adapter slots are filled per call: FSDP leaves them whole
    world.par = parallelize(model, dims, meshes, keep=lambda name: ".lora_" in name, staged=world.stages is not None)
    placement = base.placement
    if dims.pp > 1:
        placement.stages = meshes.group("pp")
    if dims.ep > 1:
        placement.experts = ExpertShard(meshes.group("ep"), meshes.rank("ep"), dims.ep, model.args.num_experts)
    if dims.tp > 1:
        placement.tp = TensorShard.of(world.par.tp_plan, base.slots, meshes.mesh("tp"))
    if on_meta:
        fill_model(model, path, device, experts)
    return base
