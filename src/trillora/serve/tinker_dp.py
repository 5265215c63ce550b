"""The Tinker service over data-parallel ranks: `torchrun --nproc-per-node N -m trillora serve MODEL --tinker`.

Every rank holds the base and every client's adapter and AdamW state; rank 0 also speaks HTTP and
queues requests on its worker. Each call that changes a client (create_model, load_state,
forward_backward, optim_step) is broadcast by rank 0 before it runs, so all ranks apply the same
calls in the same order. forward_backward splits each call's datums into contiguous blocks, one
per rank; every rank runs its block through the base, the per-call loss sums are all-reduced (so
every rank makes the same decision about a non-finite loss) and rank 0 gathers the logprobs in
datum order. optim_step all-reduces the gradients first (`parallel.data_parallel.GradientSync`) (the losses are sums over datums, so the
sum of the blocks' gradients is the whole call's), then every rank takes the same AdamW step:
the adapters stay identical without being sent. Sampling, saving and sampler sessions run on
rank 0 alone: they read an adapter every rank has, and change nothing the others need.

Here the base is replicated; `serve.tinker_sharded` splits it over tensor and expert parallel
ranks on top of this (its data-parallel group is then `dp_group`, not the world).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.data_parallel import GradientSync
from .tinker_checks import adam_settings
from .tinker_service import BadRequest, FwdBwd, TinkerService
from .tinker_types import Session

STOP = "stop"


class DataParallelService(TinkerService):
    def __init__(self, cfg, model=None):
        super().__init__(cfg, model)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.writes = self.rank == 0
        self.dp_group, self.dp_rank, self.dp_size = None, self.rank, self.world  # ranks that split the datums
        self.grad_group = None  # ranks whose gradients add up to a call's (None: the world)

    # --- what rank 0 sends ----------------------------------------------------------------
    def _mirror(self, name: str, *args) -> None:
        if self.rank == 0:
            dist.broadcast_object_list([(name, args)], src=0)

    def follow(self) -> None:
        """Ranks > 0: run rank 0's calls until it says stop. A call's BadRequest is rank 0's to
        answer; here it only means the same nothing happened."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            name, args = box[0]
            if name == STOP:
                return
            try:
                getattr(self, name)(*args)
            except BadRequest:
                pass

    def stop(self) -> None:
        self._mirror(STOP)

    def session(self, sid: str) -> Session:
        if self.rank > 0:  # sessions are opened on rank 0's HTTP threads; here they exist when used
            with self.lock:
                return self.sessions.setdefault(sid, Session(sid))
        return super().session(sid)

    # --- the calls every rank runs ----------------------------------------------------------
    def create_model(self, sid, seq, rank, roles, seed):
        self._mirror("create_model", sid, seq, rank, roles, seed)
        return super().create_model(sid, seq, rank, roles, seed)

    def load_state(self, sid, seq, tinker_path, optimizer):
        self._mirror("load_state", sid, seq, tinker_path, optimizer)
        return super().load_state(sid, seq, tinker_path, optimizer)

    def forward_backward_many(self, calls: list[FwdBwd]) -> list:
        self._mirror("forward_backward_many", calls)
        return super().forward_backward_many(calls)

    def _block(self, n: int) -> tuple[int, int]:
        return n * self.dp_rank // self.dp_size, n * (self.dp_rank + 1) // self.dp_size  # contiguous, in rank order

    def _combine(self, partial: list[torch.Tensor], logps: dict[int, list[torch.Tensor]]) -> tuple[list[float], dict]:
        """Losses summed over ranks (every rank then refuses the same non-finite calls); logprobs
        gathered in datum order."""
        totals = torch.stack([p.detach() for p in partial]) if partial else torch.zeros(0, device=self.device)
        dist.all_reduce(totals, group=self.dp_group)  # [calls]: each call's whole loss, the same on every rank
        gathered = [None] * self.dp_size
        dist.all_gather_object(gathered, {i: [lp.detach().cpu().numpy() for lp in lps] for i, lps in logps.items()},
                               group=self.dp_group)
        return totals.tolist(), {i: [lp for g in gathered for lp in g[i]] for i in logps}

    def optim_step(self, model_id: str, adam: dict) -> dict:
        self._mirror("optim_step", model_id, adam)
        client = self.client(model_id)
        adam_settings(adam)  # refused before the gradients are summed, so a retry does not sum them twice
        params = client.adapter.params
        has = torch.tensor([float(p.grad is not None) for p in params.values()], device=self.device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.grad_group)  # a rank with no rows of this client has no gradient
        for p, h in zip(params.values(), has.tolist()):
            if h and p.grad is None:
                p.grad = torch.zeros_like(p)
        return super().optim_step(model_id, adam)

    def _gradient_sync(self, params):
        """Every rank's gradients summed: the whole call's gradient, the same on every rank."""
        size = dist.get_world_size(self.grad_group)
        return GradientSync(list(params.items()), set(), self.grad_group, self.grad_group, size, size)
