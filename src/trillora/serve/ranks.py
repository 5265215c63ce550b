"""The processes a service runs on: `Ranks`, an identity in one process (no process group), and under
`torchrun --nproc-per-node N -m trillora serve MODEL --tinker [--tp T --ep K --pp P --cp C --fsdp]`
the layout `trillora train` uses (`parallel.dims`): N = P × dp × C × T ranks.

- Rank 0 speaks HTTP and runs the worker; before each call that every rank must run it broadcasts a
  typed command (`serve.commands`), and the other ranks run the commands they receive, in order.
- Data parallelism alone (the base replicated): the calls that change a client (create, load,
  forward_backward, optim_step) run everywhere; sampling, saving and sampler sessions run on rank 0,
  which holds every adapter too.
- A sharded base (`sharded`): the decoder layers in P pipeline stages (`parallel.staged`), attention
  and dense MLP layers over T tensor-parallel ranks (with sp the norms and residual, with
  vocab_parallel the head), routed experts over K ranks borrowed from dp, each row over C context
  ranks, the layers sharded over dp × cp by FSDP2. Every rank joins every pass and every sample.
- A call's datums are split over dp (`block`); the loss sums are all-reduced and the logprobs
  gathered in datum order (`combine`); the gradients are summed and measured by
  `parallel.data_parallel.GradientSync` (`gradient_sync`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ..parallel.checkpointing import apply_activation_checkpointing
from ..parallel.data_parallel import GradientSync
from ..parallel.dims import ParallelDims, ParallelError, build_meshes
from ..parallel.parallelize import parallelize
from ..parallel.pipeline import split_layers
from ..parallel.staged import StagedModel
from ..policy.adapters import ResidentBase
from ..policy.shards import ExpertShard, TensorShard
from .config import ServeConfig


class Ranks:
    def __init__(self, cfg: ServeConfig, args, alone: bool = False):
        """`args`: the model's architecture (what the layout must divide); `alone`: one process even
        where a process group exists (a reference for a parallel layout to be compared with)."""
        self.cfg, self.args = cfg, args
        parallel = dist.is_initialized() and not alone
        self.world = dist.get_world_size() if parallel else 1
        self.rank = dist.get_rank() if parallel else 0
        p = cfg.parallel
        self.sharded = p.tp > 1 or p.ep > 1 or p.pp > 1 or p.cp > 1 or (p.fsdp and self.world > p.tp * p.pp * p.cp)
        """Every rank holds part of the base: each joins every pass and every sample."""
        self.dims, self.meshes, self.stages = ParallelDims(dp=1, fsdp=False), None, None
        if self.world == 1:
            if self.sharded:
                raise ParallelError("a sharded base needs several ranks: launch with torchrun --nproc-per-node N")
            self.dp_group = self.grad_group = self.edp_group = self.tp_group = None
            self.dp_rank, self.dp_size = 0, 1
            return
        try:
            if p.ep > 1 and not args.num_experts:
                raise ParallelError(f"{cfg.model} has no routed experts to shard")
            if p.pp > args.num_layers:  # the service's stages each hold at least one layer
                raise ParallelError(
                    f"parallel.pp={p.pp} stages for {args.num_layers} layers; allowed: 1..{args.num_layers}"
                )
            dims = p.for_world(self.world)  # tp × pp × cp divide the world, ep the rest (dp) ...
            dims.check_model(args)  # ... and the experts; tp the heads, MLP widths (and the vocabulary); pp the layers
        except ParallelError as e:
            raise ParallelError(f"--tp {p.tp} --ep {p.ep} --pp {p.pp} --cp {p.cp} on {self.world} ranks: {e}") from None
        self.dims, self.meshes = dims, build_meshes(dims, torch.device(cfg.device).type)
        self.dp_group, self.dp_rank, self.dp_size = self.meshes.group("dp"), self.meshes.rank("dp"), dims.dp
        self.grad_group = self.meshes.group("dp_cp")  # cp ranks ran other positions of the same rows
        self.edp_group, self.tp_group = self.meshes.group("edp_cp"), self.meshes.group("tp")

    # --- the base ---------------------------------------------------------------------------
    def resident(self, path: Path, dtype: torch.dtype, model=None) -> ResidentBase:
        base = self._build(path, dtype, model)
        if self.cfg.precision == "bf16_weights":  # bf16 numerics at fp32 speed on a CPU
            with torch.no_grad():
                for name, p in base.model.named_parameters():
                    if ".lora_" not in name and p.is_floating_point():
                        p.copy_(p.to(torch.bfloat16))
        return base

    def _build(self, path: Path, dtype: torch.dtype, model=None) -> ResidentBase:
        """This rank's part of the base, with its adapter slots. Sharded: built on the meta device, cut
        to this rank's stage and experts, split over tp, and only then allocated and read, each rank
        reading its own part of every tensor (`checkpoint.fill_model`); a given `model` (benchmarks
        of real shapes) is split the same way after the fact."""
        from ..checkpoint import fill_model, load_model, meta_model

        cfg, dims, meshes = self.cfg, self.dims, self.meshes
        if not self.sharded:  # the base whole on every rank: of the layout, only activation checkpointing applies
            model = model if model is not None else load_model(path, dtype=dtype, device=cfg.device)
            base = ResidentBase(model, alpha=cfg.lora_alpha)
            apply_activation_checkpointing(model, cfg.parallel.activation_checkpoint_every)
            return base
        experts = (meshes.rank("ep"), dims.ep) if dims.ep > 1 else None
        layers = split_layers(self.args.num_layers, dims.pp)[meshes.rank("pp")] if dims.pp > 1 else None
        on_meta = model is None
        if on_meta:
            model = meta_model(path, dtype, experts, layers)
        if dims.pp > 1:
            model = self.stages = StagedModel(model, meshes.group("pp"), meshes.rank("pp"), dims.pp)
            self.stages.chunk_group = meshes.group("ep") if dims.ep > 1 else None
        base = ResidentBase(model, alpha=cfg.lora_alpha)
        # the adapter slots are filled per call: FSDP leaves them whole
        layout = parallelize(model, dims, meshes, keep=lambda name: ".lora_" in name, staged=self.stages is not None)
        placement = base.placement
        if dims.pp > 1:
            placement.stages = meshes.group("pp")
        if dims.ep > 1:
            placement.experts = ExpertShard(meshes.group("ep"), meshes.rank("ep"), dims.ep, model.args.num_experts)
        if dims.tp > 1:
            placement.tp = TensorShard.of(layout.tp_plan, base.slots, meshes.mesh("tp"))
        if on_meta:
            fill_model(model, path, cfg.device, experts)
        return base

    # --- commands ---------------------------------------------------------------------------
    def mirror(self, command) -> None:
        """Rank 0: tell the other ranks to run `command` too (when this layout runs it everywhere)."""
        if self.rank == 0 and self.world > 1 and (self.sharded or not command.sharded_only):
            dist.broadcast_object_list([command], src=0)

    def receive(self):
        box = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # --- a pass's datums, losses and gradients ------------------------------------------------
    def block(self, n: int) -> tuple[int, int]:
        """Which of a call's n datums this rank runs: a contiguous share, in dp rank order."""
        return n * self.dp_rank // self.dp_size, n * (self.dp_rank + 1) // self.dp_size

    def combine(
        self, partial: list[torch.Tensor], logps: dict[int, list[torch.Tensor]], device
    ) -> tuple[list[float], dict]:
        """Each call's whole loss and per-datum logprobs from every dp rank's parts: the losses summed
        (so every rank refuses the same non-finite calls), the logprobs gathered in datum order."""
        mine = {i: [lp.detach().cpu().numpy() for lp in lps] for i, lps in logps.items()}
        if self.dp_size == 1 and self.world == 1:
            return [float(p.detach()) for p in partial], mine
        totals = torch.stack([p.detach() for p in partial]) if partial else torch.zeros(0, device=device)
        dist.all_reduce(totals, group=self.dp_group)  # [calls]: each call's whole loss, the same on every rank
        gathered = [None] * self.dp_size
        dist.all_gather_object(gathered, mine, group=self.dp_group)
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
    def join_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """A rank with no rows of a client has no gradient for it: it joins the sum with zeros."""
        if self.world == 1:
            return
        has = torch.tensor([float(p.grad is not None) for p in params], device=torch.device(self.cfg.device))
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.grad_group)
        for p, h in zip(params, has.tolist(), strict=True):
            if h and p.grad is None:
                p.grad = torch.zeros_like(p)

    def gradient_sync(self, params: dict[str, torch.nn.Parameter], placement) -> GradientSync | None:
        """tp layers' partial sums completed; dense adapters summed over dp × cp; expert slices over the
        ranks that hold the same experts (expert parallelism already brought each of them every token
        routed to it); the norm counts replicated parts once, tp parts, expert slices and stages
        summed. None in one process."""
        if self.world == 1:
            return None
        d = self.dims
        experts = {k for k in params if placement.is_expert(k)}
        return GradientSync(
            list(params.items()),
            experts,
            self.grad_group,
            self.edp_group,
            d.dp * d.cp,
            d.edp * d.cp,
            placement.experts.group if d.ep > 1 else None,
            placement.stages if d.pp > 1 else None,
        )
