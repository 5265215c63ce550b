"""`parallelize(model, dims)`: the parallel plans applied to a built model, from outside.

Order: LoRA first (so adapters exist to be placed with their base layers), then the pipeline
split (each rank keeps its stages' layers), expert parallel (slices stacked experts, adds the
all-to-all hooks), tensor parallel (`parallelize_module` over the plan), context parallel
(attention gathers K/V, the backbone takes this rank's tokens), activation checkpointing
(inside the FSDP units), then FSDP2 over dp × cp. The model code is not touched. The trainer
(`policy.world`) and a service (`policy.resident`, which brings its own stage and adapter slots)
both lay the base out here.

At world size 1 without a process group there are no meshes: every plan is the identity except
activation checkpointing, and the gradient sync does nothing, so one process takes the same path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

from ..lora.apply import lora_parameters
from ..models.transformer import OtherStage
from .checkpointing import apply_activation_checkpointing
from .context_parallel import ContextParallel, apply_context_parallel
from .data_parallel import GradientSync, expert_parameter_names
from .dims import Meshes, ParallelDims, ParallelError, build_meshes
from .expert_parallel import ExpertParallel, apply_expert_parallel
from .fsdp import TrafficCounter, apply_fsdp
from .pipeline import Pipeline
from .tensor_parallel import apply_tensor_parallel


@dataclass
class Parallelized:
    dims: ParallelDims
    meshes: Meshes | None
    """None in one process without a process group (nothing to communicate over)."""
    grad_sync: GradientSync
    tp_plan: dict[str, object] = field(default_factory=dict)
    ep_plans: dict[str, ExpertParallel] = field(default_factory=dict)
    fsdp: TrafficCounter | None = None
    """FSDP2's measured collective bytes (None without FSDP)."""
    pipeline: Pipeline | None = None
    """This rank's pipeline stages (None without pp): run the model through it, not `model(...)`."""
    context: ContextParallel | None = None

    def expert_bytes(self) -> int:
        return sum(p.bytes_sent for p in self.ep_plans.values())

    def traffic(self, dp_all_reduce_bytes: int = 0) -> dict[str, float]:
        """This rank's collective bytes since the last call (then reset), by collective."""
        out = {
            "comm_dp_all_reduce_bytes": float(dp_all_reduce_bytes),
            "comm_ep_all_to_all_bytes": float(self.expert_bytes()),
        }
        if self.fsdp is not None:
            out["comm_fsdp_all_gather_bytes"] = float(self.fsdp.all_gather_out)
            out["comm_fsdp_reduce_scatter_bytes"] = float(self.fsdp.reduce_scatter_in)
            self.fsdp.reset()
        for p in self.ep_plans.values():
            p.bytes_sent = 0
        return out


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    meshes: Meshes | None = None,
    keep: Callable[[str], bool] | None = None,
    staged: bool = False,
) -> Parallelized:
    """`keep(name)`: the parameters FSDP leaves whole (a service's adapter slots, filled per call),
    named, since the plans before FSDP replace parameters. `staged`:
    `model` is already this rank's pipeline stage (`parallel.staged.StagedModel`, a service's): no
    training schedule is built, and its embedding, norm and head are FSDP units of their own (its
    chunks call each of them apart)."""
    if getattr(model, "lora_config", None) is None and dims.world_size > 1:  # one process: full training may run
        raise ParallelError("apply LoRA before parallelize(): adapters are placed with their base layers")
    if dims.dp < 1:
        raise ParallelError(f"parallel.dp={dims.dp}: resolve it for the world first (ParallelDims.for_world)")
    dims.check_model(model.args)
    if meshes is None and (dims.world_size > 1 or dist.is_initialized()):
        meshes = build_meshes(dims)

    def group(name: str):
        return meshes.group(name) if meshes is not None else None

    def rank(name: str) -> int:
        return meshes.rank(name) if meshes is not None else 0

    device = next(model.parameters()).device
    pipeline = Pipeline(model, dims, group("pp"), rank("pp"), device) if dims.pp > 1 and not staged else None
    ep_plans = apply_expert_parallel(model, group("ep"), rank("ep"), dims.ep)
    tp_plan = apply_tensor_parallel(
        model, meshes.mesh("tp") if meshes is not None else None, dims.sp, dims.vocab_parallel
    )
    context = apply_context_parallel(model, group("cp"), rank("cp"), dims.cp)
    for stage in pipeline.modules if pipeline is not None else []:  # stages compute logprobs themselves
        stage.vocab_group, stage.context = getattr(model, "vocab_parallel_group", None), context
    apply_activation_checkpointing(model, dims.activation_checkpoint_every)
    roots = pipeline.modules if pipeline else None
    if staged:
        roots = [
            m for m in (model.model.embed_tokens, model.model.norm, model.lm_head) if not isinstance(m, OtherStage)
        ]
    kept = {p for name, p in model.named_parameters() if keep is not None and keep(name)}
    fsdp = apply_fsdp(model, meshes, roots=roots, keep=kept) if dims.fsdp and meshes else None
    # with FSDP the data-parallel reductions are its reduce-scatters; what is left is tp's partial sums
    dp, edp = (1, 1) if fsdp is not None else (dims.dp * dims.cp, dims.edp * dims.cp)
    sync = GradientSync(
        list(lora_parameters(model)),
        expert_parameter_names(model),
        group("dp_cp"),
        group("edp_cp"),
        dp,
        edp,
        group("ep") if dims.ep > 1 else None,
        group("pp") if dims.pp > 1 else None,
    )
    model.parallel = dims
    return Parallelized(dims, meshes, sync, tp_plan, ep_plans, fsdp, pipeline, context)
