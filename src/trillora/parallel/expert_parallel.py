"""Expert parallelism: each rank of an `ep` group owns E/ep routed experts (and their LoRA).

The experts module takes rows already sorted by (global) expert and the rows per expert
(`GroupedExperts.forward(x_RC, counts_E)`), so expert parallelism wraps its call from
outside with two hooks, torchtitan-style:

- before: exchange counts (all-to-all of [ep, E/ep] ints), send every row to the rank that
  owns its expert (all-to-all with uneven splits), regroup the received rows by local
  expert (they arrive grouped by source rank), and call the module with local counts;
- after: undo the regrouping and send the results back (the reverse all-to-all).

Both row exchanges are differentiable (`all_to_all_single_autograd`), so gradients reach
the other ranks' tokens and every rank's expert adapters see all tokens routed to them.
Grouped GEMM runs unchanged on the local experts. When the pass holds several adapters
(`lora.multi`: a service's clients in one pass), each row's adapter travels with it, so the
expert's rank applies the right one; every rank of the group then runs such a pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from ..models.moe import GroupedExperts, shard_experts


class ExpertParallel:
    """The dispatch/combine hooks of one experts module, with the byte counts of its traffic."""

    def __init__(self, module: GroupedExperts, group, ep_rank: int, ep_size: int):
        self.group, self.rank, self.size = group, ep_rank, ep_size
        self.local = module.num_experts // ep_size
        self.first = ep_rank * self.local  # global index of this rank's first expert
        self._pending: list[tuple] = []
        self.bytes_sent = 0  # rows sent to other ranks, forward (backward moves the same again)
        module.register_forward_pre_hook(self.dispatch, with_kwargs=True)
        module.register_forward_hook(self.combine)

    def dispatch(self, module, args, kwargs):
        x_RC, counts_E = args
        send = counts_E.view(self.size, self.local)  # [dest rank, local expert]: rows this rank sends
        recv = torch.empty_like(send)
        dist.all_to_all_single(
            recv.view(-1), send.reshape(-1).contiguous(), group=self.group
        )  # [src rank, local expert]
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        x_recv = all_to_all_single_autograd(x_RC.contiguous(), out_splits, in_splits, self.group)
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.local, device=x_RC.device).repeat(self.size), recv.reshape(-1)
        )
        order = torch.argsort(expert_of_row, stable=True)  # rows by local expert, then by source rank
        self._pending.append((order, in_splits, out_splits))
        self.bytes_sent += (x_RC.shape[0] - in_splits[self.rank]) * x_RC.shape[1] * x_RC.element_size()
        token_R = kwargs.get("token_R")
        kwargs = dict(kwargs, token_R=None)  # source tokens mean nothing on the expert's rank
        multi = getattr(module, "lora_multi", None) if getattr(module, "lora_enabled", False) else None
        if multi is not None:  # each row's adapter goes with it
            if token_R is None:
                raise ValueError("rows of several adapters under expert parallelism need each row's source token")
            adapter_R = multi[0].token_adapter[token_R]
            got = adapter_R.new_empty(sum(out_splits))
            dist.all_to_all_single(got, adapter_R.contiguous(), out_splits, in_splits, group=self.group)
            kwargs["adapter_R"] = got[order]
        return (x_recv[order], recv.sum(0)), kwargs

    def combine(self, module, args, y_RC):
        order, in_splits, out_splits = self._pending.pop()
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return all_to_all_single_autograd(y_RC[back].contiguous(), in_splits, out_splits, self.group)


def apply_expert_parallel(model: nn.Module, group, ep_rank: int, ep_size: int) -> dict[str, ExpertParallel]:
    plans = {}
    if ep_size == 1:
        return plans
    for name, m in model.named_modules():
        if isinstance(m, GroupedExperts):
            shard_experts(m, ep_rank, ep_size)
            plans[name] = ExpertParallel(m, group, ep_rank, ep_size)
    return plans
