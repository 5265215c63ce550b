"""How the ranks are laid out: data, tensor and expert parallel degrees, and their meshes.

Rank r sits at (dp, tp) in the dense mesh, row-major with tp fastest, so the ranks of one
tensor-parallel group are neighbours (one node). Expert parallelism borrows its ranks from
data parallelism, as torchtitan does: the expert mesh splits dp into (edp, ep), so each
expert shard lives on `ep` ranks that hold different data, and is replicated `edp` times.
Tokens inside a tensor-parallel group are the same, so experts are not split over tp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class ParallelError(ValueError):
    """A layout that cannot work; the message names the product or divisibility that fails."""


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1
    fsdp: bool = True
    """Shard the base and adapters over dp with FSDP2; False keeps full copies and all-reduces adapter gradients."""
    sp: bool = False
    """Sequence parallelism with tp: norms and the residual stream split over the sequence."""
    vocab_parallel: bool = False
    """With tp: the head split over the vocabulary, logprobs combined without full logits."""
    activation_checkpoint_every: int = 0
    """Recompute every k-th decoder layer in backward instead of storing its activations (0 = off)."""

    def __post_init__(self) -> None:
        for key in ("dp", "tp", "ep", "pp", "cp"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ParallelError(f"parallel.{key}={value!r}; must be an integer >= 1")
        if self.pp > 1 or self.cp > 1:
            raise ParallelError(f"parallel.pp={self.pp}, parallel.cp={self.cp}: pipeline and context parallelism are "
                                "not built yet; use pp=1, cp=1")
        if not isinstance(self.activation_checkpoint_every, int) or self.activation_checkpoint_every < 0:
            raise ParallelError(f"parallel.activation_checkpoint_every={self.activation_checkpoint_every!r}; "
                                "must be an integer >= 0 (0 = off, 1 = every layer)")
        if self.dp % self.ep:
            raise ParallelError(f"parallel.ep={self.ep} must divide parallel.dp={self.dp}: expert-parallel ranks are "
                                f"data-parallel ranks (expert data parallel = dp / ep)")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def edp(self) -> int:
        """Replicas of each expert shard."""
        return self.dp // self.ep

    def check_world(self, world: int) -> None:
        if world != self.world_size:
            raise ParallelError(f"dp {self.dp} × tp {self.tp} = {self.world_size} ranks, but the job has {world}")

    def check_model(self, args) -> None:
        """Divisibility of the model's sizes by tp and ep, named."""
        checks = [("num_attention_heads", args.num_heads, self.tp)]
        if not args.kv_lora_rank:  # GQA: kv heads are split too
            checks.append(("num_key_value_heads", args.num_kv_heads, self.tp))
        if len(args.moe_layers) < args.num_layers:  # some layers have the dense MLP
            checks.append(("intermediate_size", args.intermediate_size, self.tp))
        if args.n_shared_experts:
            checks.append(("moe_intermediate_size × n_shared_experts", args.moe_intermediate_size * args.n_shared_experts, self.tp))
        if args.num_experts:
            checks.append(("num_experts", args.num_experts, self.ep))
        if self.vocab_parallel:
            checks.append(("vocab_size", args.vocab_size, self.tp))
        for name, size, by in checks:
            if size % by:
                raise ParallelError(f"{name}={size} is not divisible by {'ep' if name == 'num_experts' else 'tp'}={by}")


@dataclass
class Meshes:
    """The dense mesh ("dp", "tp") and the expert mesh ("edp", "ep", "tp") over the same ranks."""

    dims: ParallelDims
    dense: object
    experts: object

    def group(self, name: str):
        return (self.experts if name in ("edp", "ep") else self.dense).get_group(name)

    def rank(self, name: str) -> int:
        return (self.experts if name in ("edp", "ep") else self.dense).get_local_rank(name)


def build_meshes(dims: ParallelDims, device_type: str | None = None) -> Meshes:
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ParallelError("torch.distributed is not initialised: launch with torchrun (or init_process_group) first")
    dims.check_world(dist.get_world_size())
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    dense = init_device_mesh(device_type, (dims.dp, dims.tp), mesh_dim_names=("dp", "tp"))
    experts = init_device_mesh(device_type, (dims.edp, dims.ep, dims.tp), mesh_dim_names=("edp", "ep", "tp"))
    return Meshes(dims, dense, experts)
