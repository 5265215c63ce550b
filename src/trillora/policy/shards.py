"""Where this rank's part of each client adapter tensor lies when the resident base is sharded.

A parallel Tinker service (`policy.world`) splits the base as `trillora train` does:
routed experts over ep (each rank keeps rows [rank·E/ep, (rank+1)·E/ep) of every [E, ...]
tensor) and attention / dense MLP layers over tp (a column-parallel layer's B split by output
row, a row-parallel layer's A by input column, the other adapter matrix replicated; both as
DTensors, since the layer computes in DTensors). A client's adapter is created per request, after
the split, so `Placement` cuts a whole tensor to this rank's part (`shard`), and puts the parts
back together for a saved state (`full`): files always hold whole tensors and load into any
layout. Under pipeline parallelism a rank holds only its stage's slots (`roles`): `here` keeps the
tensors of those, and `full` joins the stages' tensors. Keys are adapter tensor names, bare ("m.lora_B") or as a saved
state names them
("param.m.lora_B", "optim.m.lora_B.exp_avg").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard


@dataclass(frozen=True)
class ExpertShard:
    """This rank's experts: rows [rank·E/size, (rank+1)·E/size) of every stacked tensor."""

    group: object
    rank: int
    size: int
    num_experts: int

    @property
    def rows(self) -> slice:
        local = self.num_experts // self.size
        return slice(self.rank * local, (self.rank + 1) * local)


@dataclass(frozen=True)
class TensorShard:
    """The tp mesh; which slots hold DTensors, and the adapter tensors split over tp:
    bare key -> (dim, whole size along it)."""

    mesh: object
    modules: frozenset[str]
    split: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, plan: dict, slots: dict, mesh) -> TensorShard:
        """From the tensor-parallel plan (`parallel.tensor_parallel.tp_plan`) over the adapter slots."""
        from ..parallel.tensor_parallel import LoraColwiseParallel, LoraRowwiseParallel

        split, placed = {}, set()
        for name, style in plan.items():
            if name not in slots or not isinstance(style, (LoraColwiseParallel, LoraRowwiseParallel)):
                continue  # sequence parallelism's input/output layouts leave a slot's tensors plain
            weight = slots[name].weight  # a DTensor: its shape is the whole layer's
            placed.add(name)
            if isinstance(style, LoraColwiseParallel):
                split[f"{name}.lora_B"] = (0, weight.shape[0])
            else:
                split[f"{name}.lora_A"] = (1, weight.shape[1])
        return cls(mesh, frozenset(placed), split)

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    @property
    def size(self) -> int:
        return self.mesh.size()


class Placement:
    def __init__(self, roles: dict[str, str]):
        self.roles = roles  # {slot module: role}
        self.experts: ExpertShard | None = None
        self.tp: TensorShard | None = None
        self.stages = None
        """The pipeline-parallel group, when this rank holds one stage's slots."""

    @staticmethod
    def bare(key: str) -> str:
        if key.startswith("param."):
            return key[len("param.") :]
        if key.startswith("optim."):
            return key[len("optim.") :].rpartition(".")[0]
        return key

    def here(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors of this rank's slots, and those of no slot (a saved state's RNG)."""

        def holds(key: str) -> bool:
            module, _, name = self.bare(key).rpartition(".")
            return not name.startswith("lora_") or module in self.roles

        return {k: t for k, t in tensors.items() if holds(k)}

    def is_expert(self, key: str) -> bool:
        return self.roles.get(self.bare(key).rpartition(".")[0]) == "experts"

    def is_tp_split(self, key: str) -> bool:
        return self.tp is not None and self.bare(key) in self.tp.split

    def slice(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of `t` if it is whole (a part passes through)."""
        if self.experts is not None and self.is_expert(key) and t.dim() and t.shape[0] == self.experts.num_experts:
            t = t[self.experts.rows]
        if self.is_tp_split(key) and t.dim():
            dim, whole = self.tp.split[self.bare(key)]
            if t.shape[dim] == whole:
                t = t.narrow(dim, self.tp.rank * whole // self.tp.size, whole // self.tp.size)
        return t

    def place(self, key: str, local: torch.Tensor) -> torch.Tensor:
        """`local` as the slot computes with it: a DTensor on a tensor-parallel layer."""
        if self.tp is None or self.bare(key).rpartition(".")[0] not in self.tp.modules:
            return local
        split = self.tp.split.get(self.bare(key))
        return DTensor.from_local(local, self.tp.mesh, [Shard(split[0]) if split else Replicate()], run_check=False)

    def shard(self, key: str, whole: torch.Tensor) -> torch.Tensor:
        return self.place(key, self.slice(key, whole).contiguous())

    def local(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: self.slice(k, t) for k, t in tensors.items()}

    def full(self, tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        """Whole tensors from this rank's parts (DTensors or their local parts): a collective over
        tp and ep, so every rank calls it with the same keys. NCCL gathers on `device`."""
        out = {}
        for k in sorted(tensors):  # the same order on every rank
            t, home = tensors[k], tensors[k].device
            if isinstance(t, DTensor):
                t = t.full_tensor()
            elif self.is_tp_split(k) and t.dim():
                dim, whole = self.tp.split[self.bare(k)]
                if t.shape[dim] != whole:  # a DTensor's local part, as a saved state holds it
                    t = _gather(t, dim, self.tp.size, self.tp.mesh.get_group(), device)
            if self.experts is not None and self.is_expert(k) and t.dim() and t.shape[0] != self.experts.num_experts:
                t = _gather(t, 0, self.experts.size, self.experts.group, device)
            out[k] = t.to(home)
        if self.stages is not None:  # every stage's tensors (the RNG state: the first stage's)
            parts = [None] * dist.get_world_size(self.stages)
            dist.all_gather_object(parts, {k: t.cpu() for k, t in out.items()}, group=self.stages)
            out = {k: t for part in reversed(parts) for k, t in part.items()}
        return out


def _gather(t: torch.Tensor, dim: int, size: int, group, device: torch.device) -> torch.Tensor:
    parts = [torch.empty_like(t, device=device) for _ in range(size)]
    dist.all_gather(parts, t.to(device).contiguous(), group=group)
    return torch.cat(parts, dim)
