"""The ranks a run or a service runs on, with one code path at any size: `World`.

Training (`World.start`): under torchrun, rank 0 holds the rollout engine and an unsharded copy of
the model (only the adapters change); it samples, scores and shares the batch. Each data-parallel
rank trains on its rows (tensor-, context- and pipeline-parallel ranks of one data-parallel rank
share rows: they hold other slices of the weights, other tokens, other layers), gradients are
synced over the adapter only, and after the step every rank joins the gather of the full adapter,
which rank 0 writes into its copy for the engine sync and the export.

Serving (`World.serving`, `trillora serve MODEL --tinker` under torchrun): rank 0 speaks HTTP and
runs the worker; before each call every rank must run it sends a typed command (`serve.tinker.commands`,
`mirror`), and the other ranks run the commands they receive, in order. With the base replicated
the calls that change a client run everywhere, sampling and saving on rank 0; with a sharded base
(`sharded`) every rank joins every pass and every sample. A call's datums split over dp (`block`);
the losses are all-reduced and the logprobs gathered in datum order (`combine`); the gradients
summed and measured by `parallel.data_parallel.GradientSync` (`gradient_sync`).

Rank 0's objects reach the others one way (`from_rank0`): the rollout batch, a service's commands,
the lockstep decoder's calls. In one process the same `World` has size 1: sharing, row slicing,
metric reduction and adapter gathering are identities, `parallelize` lays nothing out but activation
checkpointing, and no caller asks which case it is in (nanochat's single path, degenerating to one CPU).

    torchrun --nproc-per-node 4 -m trillora train parallel.tp=2 parallel.ep=2
    torchrun --nproc-per-node 4 -m trillora serve tiny-moe --tinker --tp 2 --ep 2
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
from ..parallel.data_parallel import GradientSync
from ..parallel.dims import Meshes, ParallelError, build_meshes
from .shards import ExpertShard, Placement


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


def from_rank0(obj):
    """Rank 0's object on every rank (what the others pass is ignored)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class World:
    rank: int
    size: int
    dims: ParallelDims
    meshes: Meshes | None
    """None in one process without a process group (nothing to communicate over)."""
    device: torch.device
    par: Parallelized | None = None
    """The layout `parallelize` applied to the model (a service's: set when its base is built)."""
    sharded: bool = False
    """A service's base is split over the ranks: every rank joins every pass and every sample."""
    stages: nn.Module | None = None
    """A service's pipeline stage on this rank (`parallel.staged.StagedModel`), under pp."""

    @staticmethod
    def of(par: Parallelized, device: torch.device, rank: int = 0, size: int = 1) -> World:
        return World(rank, size, par.dims, par.meshes, device, par)

    @staticmethod
    def start(model: nn.Module, p: ParallelDims, device: torch.device, plan=None, auto: bool = False) -> World:
        """Lay `model` out as `p` says over the ranks torchrun started (one process: nothing but
        activation checkpointing); `auto`: `plan(world size)` picks the layout instead (the planner)."""
        if not launched():
            if not auto and (p.tp, p.ep, p.pp, p.cp, max(p.dp, 1)) != (1, 1, 1, 1, 1):
                raise ConfigError(
                    f"parallel.dp={p.dp} tp={p.tp} ep={p.ep} pp={p.pp} cp={p.cp} needs a distributed "
                    f"launch: torchrun --nproc-per-node N -m trillora train ..."
                )
            # one process: nothing to lay out but activation checkpointing (which `auto` leaves to the planner)
            dims = ParallelDims(activation_checkpoint_every=0 if auto else p.activation_checkpoint_every)
            return World.of(parallelize(model, dims), device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        world = dist.get_world_size()
        dims = plan(world) if auto else p.for_world(world)
        return World.of(parallelize(model, dims), device, dist.get_rank(), world)

    @staticmethod
    def serving(p: ParallelDims, args, device: torch.device, model_name: str, alone: bool = False) -> World:
        """A service's ranks: the process group torchrun's launch made (unless `alone`: one process
        even there, a reference for a parallel layout to be compared with), laid out as `p` says
        for `args` (the model's architecture, what the layout must divide). The base itself is
        built on it by `policy.resident`."""
        parallel = dist.is_initialized() and not alone
        size, rank = (dist.get_world_size(), dist.get_rank()) if parallel else (1, 0)
        sharded = p.tp > 1 or p.ep > 1 or p.pp > 1 or p.cp > 1 or (p.fsdp and size > p.tp * p.pp * p.cp)
        if size == 1:
            if sharded:
                raise ParallelError("a sharded base needs several ranks: launch with torchrun --nproc-per-node N")
            return World(0, 1, ParallelDims(dp=1, fsdp=False), None, device)
        try:
            if p.ep > 1 and not args.num_experts:
                raise ParallelError(f"{model_name} has no routed experts to shard")
            if p.pp > args.num_layers:  # the service's stages each hold at least one layer
                raise ParallelError(
                    f"parallel.pp={p.pp} stages for {args.num_layers} layers; allowed: 1..{args.num_layers}"
                )
            dims = p.for_world(size)  # tp × pp × cp divide the world, ep the rest (dp) ...
            dims.check_model(args)  # ... and the experts; tp the heads, MLP widths (and the vocabulary); pp the layers
        except ParallelError as e:
            raise ParallelError(f"--tp {p.tp} --ep {p.ep} --pp {p.pp} --cp {p.cp} on {size} ranks: {e}") from None
        return World(rank, size, dims, build_meshes(dims, device.type), device, sharded=sharded)

    @property
    def main(self) -> bool:
        """The rank that samples, evaluates and writes files."""
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.meshes.rank("dp") if self.meshes is not None else 0

    def group(self, name: str):
        """The process group of mesh dimension `name` (None in one process)."""
        return self.meshes.group(name) if self.meshes is not None else None

    def share(self, payload):
        """Rank 0's object (the rollout batch) on every rank."""
        return from_rank0(payload if self.main else None) if self.size > 1 else payload

    def rows(self, b: int) -> slice:
        """This rank's rows of b: contiguous equal blocks by data-parallel rank."""
        dp = self.dims.dp
        if b % dp:
            raise ConfigError(
                f"a minibatch of {b} rows does not split over dp={dp}: make rollout.prompts_per_step × "
                f"group_size a multiple of algorithm.minibatches × dp"
            )
        return slice(*self.block(b))

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
        dist.all_reduce(t, group=self.group("dp"))
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
        """Shards joined over tp (and FSDP's dp) and ep within a pipeline stage, then the stages' parts:
        `Placement.full`, as a service gathers a client's adapter."""
        placement = Placement(getattr(model, "lora_targets", {}))  # none: full-parameter training
        if self.dims.ep > 1:
            ep = self.group("ep")
            placement.experts = ExpertShard(ep, dist.get_rank(ep), self.dims.ep, model.args.num_experts)
        placement.stages = self.group("pp") if self.dims.pp > 1 else None
        return placement.full({k: p.detach() for k, p in lora_parameters(model)}, self.device)

    # --- a service's commands and passes -----------------------------------------------------
    def mirror(self, command) -> None:
        """Rank 0: tell the other ranks to run `command` too (when this layout runs it everywhere)."""
        if self.rank == 0 and self.size > 1 and (self.sharded or not command.sharded_only):
            from_rank0(command)

    def receive(self):
        """The other ranks: rank 0's next command."""
        return from_rank0(None)

    def block(self, n: int) -> tuple[int, int]:
        """Which of a call's n datums this rank runs: a contiguous share, in dp rank order."""
        return n * self.dp_rank // self.dims.dp, n * (self.dp_rank + 1) // self.dims.dp

    def combine(
        self, partial: list[torch.Tensor], logps: dict[int, list[torch.Tensor]], device
    ) -> tuple[list[float], dict]:
        """Each call's whole loss and per-datum logprobs from every dp rank's parts: the losses summed
        (so every rank refuses the same non-finite calls), the logprobs gathered in datum order."""
        mine = {i: [lp.detach().cpu().numpy() for lp in lps] for i, lps in logps.items()}
        if self.size == 1:
            return [float(p.detach()) for p in partial], mine
        totals = torch.stack([p.detach() for p in partial]) if partial else torch.zeros(0, device=device)
        dist.all_reduce(totals, group=self.group("dp"))  # [calls]: each call's whole loss, the same on every rank
        gathered = [None] * self.dims.dp
        dist.all_gather_object(gathered, mine, group=self.group("dp"))
        return totals.tolist(), {i: [lp for g in gathered for lp in g[i]] for i in logps}

    def pass_adapters(self, live: list, mine: list) -> tuple[list, list[int]]:
        """A pass's adapters and their rows here, from (index, call, adapter, first, end) of every live
        call and of those with datums here (`mine`). Replicated: the adapters of `mine`. Sharded:
        every call's adapter on every rank, in call order, with 0 rows where none of its datums are
        here (the ranks of an expert-parallel group number the adapters alike), a rank with no
        datums running its filler token with the first; under pp the pass (of one call or several:
        each chunk's rows keep their adapters, `RowAdapters.select_rows`) runs as `--pp-microbatches` chunks."""
        if not self.sharded:
            return [a for _, _, a, _, _ in mine] or [live[0][2]], [hi - lo for *_, lo, hi in mine] or [1]
        rows = [hi - lo for *_, lo, hi in live]
        if not any(rows):
            rows[0] = 1
        if self.stages is not None:
            self.stages.microbatches = self.dims.pp_microbatches or self.dims.pp
        return [a for _, _, a, _, _ in live], rows

    @torch.no_grad()
    def join_gradients(self, params: list[nn.Parameter]) -> None:
        """A rank with no rows of a client has no gradient for it: it joins the sum with zeros."""
        if self.size == 1:
            return
        has = torch.tensor([float(p.grad is not None) for p in params], device=self.device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.group("dp_cp"))
        for p, h in zip(params, has.tolist(), strict=True):
            if h and p.grad is None:
                p.grad = torch.zeros_like(p)

    def gradient_sync(self, params: dict[str, nn.Parameter], placement) -> GradientSync | None:
        """A service adapter's: tp layers' partial sums completed; dense adapters summed over dp × cp;
        expert slices over the ranks that hold the same experts (expert parallelism already brought
        each of them every token routed to it); the norm counts replicated parts once, tp parts,
        expert slices and stages summed. None in one process."""
        if self.size == 1:
            return None
        d = self.dims
        return GradientSync(
            list(params.items()),
            {k for k in params if placement.is_expert(k)},
            self.group("dp_cp"),  # cp ranks ran other positions of the same rows
            self.group("edp_cp"),
            d.dp * d.cp,
            d.edp * d.cp,
            placement.experts.group if d.ep > 1 else None,
            placement.stages if d.pp > 1 else None,
        )

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
