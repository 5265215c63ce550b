"""The Tinker service with its routed experts sharded: `torchrun --nproc-per-node N -m trillora serve MODEL --tinker --ep K`.

Expert parallelism borrows its ranks from data parallelism, as in training (`parallel.dims`): the
N ranks split each call's datums as `serve.tinker_dp` does, and each rank keeps E/K of every MoE
layer's experts, with every client's adapter slices for them, so a large MoE's experts and the
clients' expert adapters cost 1/K per rank. What changes from the replicated service:

- every rank joins every pass through the base, since each MoE layer's all-to-all sends routed
  rows to the rank that owns their expert. A rank with no datums of a call runs one token
  weighted 0. A pass holds one client's rows (a routed row's adapter does not travel with it);
- optim_step sums the dense adapters' gradients over all ranks and the expert slices' over the
  ranks holding the same experts (N/K); the clipping norm adds every slice once;
- saved states and sampler weights are whole (gathered over the ep group) and load into any layout;
- sampling runs on rank 0, whose engine drives the passes; before each forward it names the
  sampler to the others, which run one token through the same revision to serve their experts.
  So sampler sessions (saved, loaded, or the base's) exist on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.dims import ParallelDims, ParallelError, build_meshes
from ..parallel.expert_parallel import apply_expert_parallel
from .adapters import ExpertShard
from .tinker_dp import DataParallelService, sum_over


class ExpertParallelService(DataParallelService):
    joins_every_pass = True

    def __init__(self, cfg, model=None):
        super().__init__(cfg, model)
        args = self.base.model.args
        try:
            if not args.num_experts:
                raise ParallelError(f"{cfg.model} has no routed experts to shard")
            dims = ParallelDims(dp=self.world, ep=cfg.ep)  # ep must divide the ranks ...
            dims.check_model(args)  # ... and the experts
        except ParallelError as e:
            raise ParallelError(f"--ep {cfg.ep} on {self.world} ranks: {e}") from None
        meshes = build_meshes(dims, self.device.type)
        self.plans = apply_expert_parallel(self.base.model, meshes.group("ep"), meshes.rank("ep"), cfg.ep)
        self.base.experts = ExpertShard(meshes.group("ep"), meshes.rank("ep"), cfg.ep, args.num_experts)
        self.edp_group, self.edp = meshes.group("edp"), dims.edp

    # --- the calls every rank runs, beyond data parallelism's ---------------------------------
    def save_state(self, model_id, name, optimizer=True):
        self._mirror("save_state", model_id, name, optimizer)
        return super().save_state(model_id, name, optimizer)

    def save_for_sampler(self, model_id, name, sid=None, sampler_seq=0):
        self._mirror("save_for_sampler", model_id, name, sid, sampler_seq)
        return super().save_for_sampler(model_id, name, sid, sampler_seq)

    def create_sampler(self, sid, seq, model_path, base_model):
        self._mirror("create_sampler", sid, seq, model_path, base_model)
        return super().create_sampler(sid, seq, model_path, base_model)

    def forward_backward_many(self, calls):
        """One pass per call, every rank in each (`ResidentBase.use_many` cannot route adapters)."""
        outcomes = []
        for c in calls:
            outcomes += super().forward_backward_many([c])
        return outcomes

    def sample_many(self, calls):
        self._mirror("sample_many", calls)
        if self.rank == 0:
            hook = self.base.model.register_forward_pre_hook(lambda *_: self._announce(self.base.in_use.sampler_id))
            try:
                return super().sample_many(calls)
            finally:
                hook.remove()
                self._announce(None)
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        while (sampler_id := self._announced()) is not None:
            with self.base.use(self.sampler(sampler_id)) as model, torch.no_grad():
                model(ids)
        return []

    def _announce(self, sampler_id: str | None) -> None:
        dist.broadcast_object_list([sampler_id], src=0)

    def _announced(self) -> str | None:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # --- gradients ----------------------------------------------------------------------------
    def _sum_gradients(self, params):
        """Dense adapters over every rank; expert slices over the ranks that hold the same experts
        (expert parallelism already brought each of them every token routed to it)."""
        dense = [p.grad for k, p in params.items() if p.grad is not None and not self.base.expert_param(k)]
        sum_over(dense, None)
        if self.edp > 1:
            sum_over([p.grad for k, p in params.items() if p.grad is not None and self.base.expert_param(k)],
                     self.edp_group)

    @torch.no_grad()
    def _grad_norm(self, adapter) -> float:
        squares = torch.zeros(2, dtype=torch.float64, device=self.device)  # [dense, this rank's expert slices]
        for k, p in adapter.params.items():
            if p.grad is not None:
                squares[int(self.base.expert_param(k))] += p.grad.double().square().sum()
        experts = squares[1:].clone()
        dist.all_reduce(experts, group=self.base.experts.group)
        return float((squares[0] + experts[0]).sqrt())
