"""How the ranks are laid out: pipeline, data, context, tensor and expert parallel degrees, and their meshes.

Rank r sits at (pp, dp, cp, tp) in the dense mesh, row-major with tp fastest, so the ranks
of one tensor-parallel group are neighbours (one node) and pipeline stages are the outermost
split (the slow links between nodes carry only stage boundaries). Expert parallelism borrows
its ranks from data parallelism, as torchtitan does: the expert mesh splits dp into
(edp, ep), so each expert shard lives on `ep` ranks that hold different data, and is
replicated `edp` times. Tokens inside a tensor-parallel group are the same, so experts are
not split over tp. Context-parallel ranks hold other tokens of the same rows, so gradients
are summed over dp × cp ("dp_cp") and expert gradients over edp × cp ("edp_cp").
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, get_args

import torch
import torch.distributed as dist

from ..errors import ConfigError


class ParallelError(ConfigError):
    """A layout that cannot work; the message names the product or divisibility that fails."""


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    """Data-parallel replicas; 0 = what is left of the world after pp × cp × tp (`for_world`)."""
    tp: int = 1
    """Tensor parallelism: attention heads and MLP widths split over groups of this many ranks."""
    ep: int = 1
    """Expert parallelism: the routed experts split over groups of this many (data-parallel) ranks."""
    pp: int = 1
    """Pipeline parallelism: the decoder layers cut into this many stages, one per rank of a group."""
    cp: int = 1
    """Context parallelism: each row's tokens split over this many ranks (long sequences)."""
    fsdp: bool = True
    """Shard the base and adapters over dp with FSDP2; False keeps full copies and all-reduces adapter gradients."""
    sp: bool = False
    """Sequence parallelism with tp: norms and the residual stream split over the sequence."""
    vocab_parallel: bool = False
    """With tp: the head split over the vocabulary, logprobs combined without full logits."""
    activation_checkpoint_every: int = 0
    """Recompute every k-th decoder layer in backward instead of storing its activations (0 = off)."""
    pp_schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule: one of `PP_SCHEDULES` (interleaved and zero-bubble ones run 2 stages per rank)."""
    pp_microbatches: int = 0
    """Microbatches per pipeline step (0 = the number of stages, the fewest that fill the pipeline)."""
    pp_stage_layers: tuple[int, ...] = ()
    """Decoder layers per stage, first to last (sums to the model's layers; 0 allowed at the ends:
    a first stage of embeddings only, a last one of norm and head); () = as even as possible."""

    def __post_init__(self) -> None:
        for key in ("tp", "ep", "pp", "cp"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ParallelError(f"parallel.{key}={value!r}; must be an integer >= 1")
        if not isinstance(self.dp, int) or self.dp < 0:
            raise ParallelError(f"parallel.dp={self.dp!r}; must be an integer >= 1 (0 = the rest of the world)")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ParallelError(f"parallel.pp_schedule={self.pp_schedule!r}; allowed: {', '.join(PP_SCHEDULES)}")
        if not isinstance(self.pp_microbatches, int) or self.pp_microbatches < 0:
            raise ParallelError(
                f"parallel.pp_microbatches={self.pp_microbatches!r}; must be an integer >= 0 (0 = stages)"
            )
        object.__setattr__(self, "pp_stage_layers", tuple(self.pp_stage_layers))
        if self.pp_stage_layers and (
            len(self.pp_stage_layers) != self.num_stages
            or any(not isinstance(n, int) or n < 0 for n in self.pp_stage_layers)
        ):
            raise ParallelError(
                f"parallel.pp_stage_layers={list(self.pp_stage_layers)}: need {self.num_stages} counts "
                f">= 0 (pp={self.pp} × {self.stages_per_rank} stages per rank for {self.pp_schedule})"
            )
        if self.pp > 1 and self.sp:
            raise ParallelError(
                "parallel.sp with parallel.pp > 1: sequence-sharded activations cannot cross pipeline "
                "stages yet; use sp=false"
            )
        if not isinstance(self.activation_checkpoint_every, int) or self.activation_checkpoint_every < 0:
            raise ParallelError(
                f"parallel.activation_checkpoint_every={self.activation_checkpoint_every!r}; "
                "must be an integer >= 0 (0 = off, 1 = every layer)"
            )
        if self.dp and self.dp % self.ep:
            raise ParallelError(
                f"parallel.ep={self.ep} must divide parallel.dp={self.dp}: expert-parallel ranks are "
                f"data-parallel ranks (expert data parallel = dp / ep)"
            )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def stages_per_rank(self) -> int:
        return 1 if PP_SCHEDULES[self.pp_schedule] == "single" else 2

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def edp(self) -> int:
        """Replicas of each expert shard."""
        return self.dp // self.ep

    def for_world(self, world: int) -> ParallelDims:
        """These degrees on `world` ranks, dp = 0 resolved to what pp × cp × tp leave."""
        rest = self.tp * self.pp * self.cp
        if world % rest:
            raise ParallelError(
                f"parallel.tp={self.tp} × pp={self.pp} × cp={self.cp} = {rest} does not divide the "
                f"{world} ranks of this job"
            )
        dims = ParallelDims(
            **{f.name: getattr(self, f.name) for f in fields(ParallelDims)} | {"dp": self.dp or world // rest}
        )
        dims.check_world(world)
        return dims

    def check_world(self, world: int) -> None:
        if world != self.world_size:
            raise ParallelError(
                f"pp {self.pp} × dp {self.dp} × cp {self.cp} × tp {self.tp} = {self.world_size} ranks, "
                f"but the job has {world}"
            )

    def check_model(self, args) -> None:
        """Divisibility of the model's sizes by tp and ep, named."""
        checks = [("num_attention_heads", args.num_heads, self.tp)]
        if not args.kv_lora_rank:  # GQA: kv heads are split too
            checks.append(("num_key_value_heads", args.num_kv_heads, self.tp))
        if len(args.moe_layers) < args.num_layers:  # some layers have the dense MLP
            checks.append(("intermediate_size", args.intermediate_size, self.tp))
        if args.n_shared_experts:
            checks.append(
                (
                    "moe_intermediate_size × n_shared_experts",
                    args.moe_intermediate_size * args.n_shared_experts,
                    self.tp,
                )
            )
        if args.num_experts:
            checks.append(("num_experts", args.num_experts, self.ep))
        if self.vocab_parallel:
            checks.append(("vocab_size", args.vocab_size, self.tp))
        for name, size, by in checks:
            if size % by:
                raise ParallelError(f"{name}={size} is not divisible by {'ep' if name == 'num_experts' else 'tp'}={by}")
        if self.pp_stage_layers and sum(self.pp_stage_layers) != args.num_layers:
            raise ParallelError(
                f"parallel.pp_stage_layers={list(self.pp_stage_layers)} sums to "
                f"{sum(self.pp_stage_layers)}, but the model has {args.num_layers} layers"
            )
        if self.pp > 1 and args.tie_word_embeddings:
            raise ParallelError(
                "tie_word_embeddings=true with parallel.pp > 1: the first and last stage would both need "
                "the shared matrix; use pp=1"
            )


PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv"]
# name -> "single" (one stage per rank) or "multi" (two: interleaved loop, or V for zbv)
PP_SCHEDULES = {
    "gpipe": "single",
    "1f1b": "single",
    "interleaved_1f1b": "multi",
    "interleaved_zero_bubble": "multi",
    "zbv": "multi",
}
assert tuple(PP_SCHEDULES) == get_args(PipelineSchedule)


@dataclass
class Meshes:
    """The dense mesh ("pp", "dp", "cp", "tp") and the expert mesh ("pp", "edp", "ep", "cp", "tp")
    over the same ranks, with the flattened "dp_cp" and "edp_cp" that gradients are summed over."""

    dims: ParallelDims
    dense: object
    experts: object

    def mesh(self, name: str):
        return (self.experts if name in ("edp", "ep", "edp_cp") else self.dense)[name]

    def group(self, name: str):
        return self.mesh(name).get_group()

    def rank(self, name: str) -> int:
        return self.mesh(name).get_local_rank()


def build_meshes(dims: ParallelDims, device_type: str | None = None) -> Meshes:
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ParallelError("torch.distributed is not initialised: launch with torchrun (or init_process_group) first")
    dims.check_world(dist.get_world_size())
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    dense = init_device_mesh(device_type, (dims.pp, dims.dp, dims.cp, dims.tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    experts = init_device_mesh(
        device_type, (dims.pp, dims.edp, dims.ep, dims.cp, dims.tp), mesh_dim_names=("pp", "edp", "ep", "cp", "tp")
    )
    dense["dp", "cp"]._flatten("dp_cp")
    experts["edp", "cp"]._flatten("edp_cp")
    return Meshes(dims, dense, experts)
