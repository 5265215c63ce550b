"""The trainer under torchrun: rank 0 samples, every rank learns its share.

Rank 0 holds the rollout engine and an unsharded copy of the model (adapters only change);
it samples, scores and broadcasts the batch. Each data-parallel rank trains on its rows
(tensor-, context- and pipeline-parallel ranks of one data-parallel rank share rows: they
hold other slices of the weights, other tokens, other layers), gradients are synced over the
adapter only, and after the step every rank joins the gather of the full adapter, which
rank 0 writes into its copy for the engine sync and the export.

    torchrun --nproc-per-node 4 -m trillora train parallel.tp=2 parallel.ep=2
    torchrun --nproc-per-node 4 -m trillora train parallel.pp=2 parallel.cp=2
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .lora.apply import lora_parameters
from .parallel import Parallelized, parallelize
from .parallel.data_parallel import expert_parameter_names, local_tensor


def launched() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass
class Distributed:
    rank: int
    world: int
    par: Parallelized

    @staticmethod
    def start(model: nn.Module, cfg, device: torch.device) -> "Distributed":
        """`cfg`: the run config; its `parallel` section, or the planner when `parallel.auto`."""
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        world = dist.get_world_size()
        if cfg.parallel.auto:
            from .config import ConfigError
            from .parallel import ParallelError
            from .parallel.planner import auto_dims

            r = cfg.rollout
            try:
                dims, _ = auto_dims(model.args, cfg.lora, world, seq_len=r.max_model_len,
                                    rows=r.prompts_per_step * r.group_size, minibatches=cfg.algorithm.minibatches,
                                    device=device)
            except ParallelError as e:
                raise ConfigError(str(e)) from None
        else:
            dims = cfg.parallel.dims(world)
        return Distributed(dist.get_rank(), world, parallelize(model, dims))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def share(self, payload):
        """Rank 0's object (the batch, rewards, completions) on every rank."""
        box = [payload if self.main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def rows(self, b: int) -> slice:
        """This rank's rows of a batch of b: contiguous blocks by data-parallel rank."""
        dp, r = self.par.dims.dp, self.par.meshes.rank("dp")
        if b % dp:
            raise ValueError(f"batch of {b} rows does not split over dp={dp}; make prompts_per_step × group_size a multiple")
        return slice(r * b // dp, (r + 1) * b // dp)

    def reduce_metrics(self, per_token: dict[str, float], tokens: float, summed: dict[str, float],
                       averaged: dict[str, float]) -> dict[str, float]:
        """Metrics of the data-parallel ranks combined as one process would have them: per-token
        means weighted by each rank's tokens, partial sums added, the rest averaged (tp, cp and
        pp ranks of one data-parallel rank hold the same values)."""
        groups = [sorted(per_token), sorted(summed), sorted(averaged)]
        t = torch.tensor([per_token[k] * tokens for k in groups[0]] + [tokens] + [summed[k] for k in groups[1]]
                         + [averaged[k] for k in groups[2]], dtype=torch.float64)
        dist.all_reduce(t, group=self.par.meshes.group("dp"))
        v = t.tolist()
        n, total = len(groups[0]), max(v[len(groups[0])], 1.0)
        out = {k: x / total for k, x in zip(groups[0], v[:n])}
        out.update(zip(groups[1], v[n + 1:n + 1 + len(groups[1])]))
        out.update((k, x / self.par.dims.dp) for k, x in zip(groups[2], v[n + 1 + len(groups[1]):]))
        return out

    @torch.no_grad()
    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The global L2 norm of the adapter gradient (after `grad_sync`): squares summed over every
        mesh dimension a gradient is sharded on (tp, dp under FSDP) and over ep for expert shards."""
        experts = expert_parameter_names(model)
        buckets: dict[tuple, list] = {}
        for name, p in lora_parameters(model):
            if p.grad is None:
                continue
            g = p.grad
            names, groups = [], []
            if hasattr(g, "placements"):
                mesh = g.device_mesh
                for i, pl in enumerate(g.placements):
                    if pl.is_shard():
                        names.append(mesh.mesh_dim_names[i] if mesh.mesh_dim_names else str(i))
                        groups.append(mesh.get_group(i))
            if name in experts and self.par.dims.ep > 1:
                names.append("ep")
                groups.append(self.par.meshes.group("ep"))
            key = tuple(names)  # mesh dimension names: the same on every rank, so the collectives line up
            bucket = buckets.setdefault(key, [torch.zeros((), dtype=torch.float64), groups])
            bucket[0] += local_tensor(g).double().square().sum()
        total = torch.zeros((), dtype=torch.float64)
        for key in sorted(buckets):  # the same order on every rank of a pipeline stage
            sq, groups = buckets[key]
            for group in groups:
                dist.all_reduce(sq, group=group)
            total += sq
        if self.par.dims.pp > 1:  # each pipeline rank holds other layers' adapters
            dist.all_reduce(total, group=self.par.meshes.group("pp"))
        return total.sqrt().float()

    @torch.no_grad()
    def clip_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        norm = self.grad_norm(model)
        if math.isfinite(float(norm)) and max_norm > 0:
            coef = min(1.0, max_norm / (float(norm) + 1e-6))
            for _, p in lora_parameters(model):
                if p.grad is not None:
                    local_tensor(p.grad).mul_(coef)
        return norm

    @torch.no_grad()
    def gather_adapter(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full adapter tensors (every rank takes part; the result is used on rank 0): shards joined
        over tp (and FSDP's dp) and ep within a pipeline stage, then the stages' parts joined."""
        experts = expert_parameter_names(model)
        out = {}
        for name, p in lora_parameters(model):
            t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            if name in experts and self.par.dims.ep > 1:
                parts = [torch.empty_like(t) for _ in range(self.par.dims.ep)]
                dist.all_gather(parts, t.contiguous(), group=self.par.meshes.group("ep"))
                t = torch.cat(parts, dim=0)
            out[name] = t
        if self.par.dims.pp > 1:
            stages = [None] * self.par.dims.pp
            dist.all_gather_object(stages, {k: v.cpu() for k, v in out.items()}, group=self.par.meshes.group("pp"))
            device = next(model.parameters()).device
            out = {k: v.to(device) for part in stages for k, v in part.items()}
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def load_adapter_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy gathered adapter tensors into an unsharded model with the same adapters."""
    with torch.no_grad():
        for name, p in lora_parameters(model):
            p.copy_(tensors[name])
