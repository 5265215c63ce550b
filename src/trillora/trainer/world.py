"""The ranks a run trains on, with one code path at any size.

Under torchrun, rank 0 holds the rollout engine and an unsharded copy of the model (only the
adapters change); it samples, scores and shares the batch. Each data-parallel rank trains on its
rows (tensor-, context- and pipeline-parallel ranks of one data-parallel rank share rows: they
hold other slices of the weights, other tokens, other layers), gradients are synced over the
adapter only, and after the step every rank joins the gather of the full adapter, which rank 0
writes into its copy for the engine sync and the export.

In one process the same `World` has size 1: sharing, row slicing, metric reduction and adapter
gathering are identities, `parallelize` lays nothing out but activation checkpointing, and the
loop never asks which case it is in (nanochat's single path, degenerating to one CPU).

    torchrun --nproc-per-node 4 -m trillora train parallel.tp=2 parallel.ep=2
    torchrun --nproc-per-node 4 -m trillora train parallel.pp=2 parallel.cp=2
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import typing
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..lora.apply import lora_parameters
from ..parallel import ParallelDims, Parallelized, parallelize
from ..parallel.data_parallel import expert_parameter_names


def launched() -> bool:
    """Started by torchrun with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def leave_rank(code: int) -> typing.NoReturn:
    """A torchrun rank ends without the interpreter's teardown, as multiprocessing's fork and forkserver children do.

    gloo's worker threads free a finished collective's tensors a moment after the caller's `wait`
    returns; when that moment falls inside teardown the thread cannot take the GIL and the process
    aborts (`terminate called without an active exception`, exit -6, after a run that finished:
    1 in 5 to 1 in 7 two-rank runs on a loaded 2-core machine). Everything a run writes is closed by
    now; `atexit` handlers (a user's reward module's, say) do not run on the ranks.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def pick_device(name: str) -> torch.device:
    """`auto`: CUDA when there is one; under torchrun each rank takes its LOCAL_RANK's GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError('device=\'cuda\' but no CUDA device is available; use device="cpu" or "auto"')
    device = torch.device(name)
    if launched() and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return device


@dataclass
class World:
    rank: int
    size: int
    par: Parallelized
    device: torch.device

    @staticmethod
    def start(model: nn.Module, cfg, device: torch.device) -> World:
        """Lay `model` out as the run's `parallel` section (or the planner, `parallel.auto`) says."""
        p = cfg.parallel
        if not launched():
            if not p.auto and (p.tp, p.ep, p.pp, p.cp, max(p.dp, 1)) != (1, 1, 1, 1, 1):
                raise ConfigError(
                    f"parallel.dp={p.dp} tp={p.tp} ep={p.ep} pp={p.pp} cp={p.cp} needs a distributed "
                    f"launch: torchrun --nproc-per-node N -m trillora train ..."
                )
            # one process: nothing to lay out but activation checkpointing (which `auto` leaves to the planner)
            dims = ParallelDims(activation_checkpoint_every=0 if p.auto else p.activation_checkpoint_every)
            return World(0, 1, parallelize(model, dims), device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        world = dist.get_world_size()
        if p.auto:
            from ..plan.planner import auto_dims

            r = cfg.rollout
            dims, _ = auto_dims(
                model.args,
                cfg.lora,
                world,
                seq_len=r.max_model_len,
                rows=r.prompts_per_step * r.group_size,
                minibatches=cfg.algorithm.minibatches,
                device=device,
            )
        else:
            dims = p.for_world(world)
        return World(dist.get_rank(), world, parallelize(model, dims), device)

    @property
    def main(self) -> bool:
        """The rank that samples, evaluates and writes files."""
        return self.rank == 0

    @property
    def dims(self) -> ParallelDims:
        return self.par.dims

    @property
    def dp_rank(self) -> int:
        return self.par.meshes.rank("dp") if self.par.meshes is not None else 0

    def share(self, payload):
        """Rank 0's object (the rollout batch) on every rank."""
        if self.size == 1:
            return payload
        box = [payload if self.main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def rows(self, b: int) -> slice:
        """This rank's rows of b: contiguous blocks by data-parallel rank."""
        dp = self.dims.dp
        if b % dp:
            raise ConfigError(
                f"a minibatch of {b} rows does not split over dp={dp}: make rollout.prompts_per_step × "
                f"group_size a multiple of algorithm.minibatches × dp"
            )
        return slice(self.dp_rank * b // dp, (self.dp_rank + 1) * b // dp)

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on one (a stop request every rank must act on)."""
        if self.size == 1:
            return flag
        t = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def layout(self) -> dict:
        """As state.json holds it (JSON lists, not tuples), so a reloaded one compares equal."""
        return json.loads(
            json.dumps({"world": self.size, "dims": dataclasses.asdict(self.dims)} if self.size > 1 else {"world": 1})
        )

    def reduce_metrics(
        self, per_token: dict[str, float], tokens: float, summed: dict[str, float], averaged: dict[str, float]
    ) -> dict[str, float]:
        """Metrics of the data-parallel ranks combined as one process would have them: per-token
        means weighted by each rank's tokens, partial sums added, the rest averaged (tp, cp and
        pp ranks of one data-parallel rank hold the same values)."""
        if self.size == 1:
            return {**per_token, **summed, **averaged}
        groups = [sorted(per_token), sorted(summed), sorted(averaged)]
        t = torch.tensor(
            [per_token[k] * tokens for k in groups[0]]
            + [tokens]
            + [summed[k] for k in groups[1]]
            + [averaged[k] for k in groups[2]],
            dtype=torch.float64,
        )
        dist.all_reduce(t, group=self.par.meshes.group("dp"))
        v = t.tolist()
        n, total = len(groups[0]), max(v[len(groups[0])], 1.0)
        out = {k: x / total for k, x in zip(groups[0], v[:n], strict=True)}
        out.update(zip(groups[1], v[n + 1 : n + 1 + len(groups[1])], strict=True))
        out.update((k, x / self.dims.dp) for k, x in zip(groups[2], v[n + 1 + len(groups[1]) :], strict=True))
        return out

    # --- the adapter ------------------------------------------------------------------------
    @torch.no_grad()
    def unsharded(self, model: nn.Module, full: nn.Module | None) -> nn.Module | None:
        """The whole model with the current adapter, for the engine sync and the export: `model`
        itself in one process; under torchrun every rank joins the gather and rank 0 gets `full`
        (its unsharded copy) with the gathered adapter written in, the others None."""
        if self.size == 1:
            return model
        tensors = self._gather_adapter(model)
        if not self.main:
            return None
        for name, p in lora_parameters(full):
            p.copy_(tensors[name])
        return full

    def _gather_adapter(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Shards joined over tp (and FSDP's dp) and ep within a pipeline stage, then the stages' parts."""
        experts = expert_parameter_names(model)
        out = {}
        for name, p in lora_parameters(model):
            t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            if name in experts and self.dims.ep > 1:
                parts = [torch.empty_like(t) for _ in range(self.dims.ep)]
                dist.all_gather(parts, t.contiguous(), group=self.par.meshes.group("ep"))
                t = torch.cat(parts, dim=0)
            out[name] = t
        if self.dims.pp > 1:
            stages = [None] * self.dims.pp
            dist.all_gather_object(stages, {k: v.cpu() for k, v in out.items()}, group=self.par.meshes.group("pp"))
            device = next(model.parameters()).device
            out = {k: v.to(device) for part in stages for k, v in part.items()}
        return out

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
