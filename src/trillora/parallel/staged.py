"""A pipeline stage called like the whole model: pipeline parallelism for a service.

`parallel.pipeline` trains with torch's schedules (1F1B, interleaved, zero-bubble), whose loss must
live on the last stage and see next-token logprobs only; it also decodes, stage by stage. A Tinker
service asks what those schedules cannot give: logits at any targets ([N] or [N, K]) handed to a
loss the client chose, whose gradient then crosses the stages by hand, and per-row
adapters (`lora.multi`) that must follow each chunk. Two implementations stay for that reason.
`StagedModel` is this rank's part of a `CausalLM` under the model's own names
(`model.layers.3....`, so adapters, plans and saved states see the usual names), and
`staged(input_ids, attention_mask, position_ids, cache, logits_to_keep)` runs one batch through
the pp ranks in order: each receives the hidden states from the stage before, runs its layers
(keeping their keys and values in `cache`), and sends them on. The logits are the last stage's
(None elsewhere); with `share_logits` on they reach every stage (decoding: every pp rank runs the
same sampling loop and must pick the same tokens).

Backward crosses stages explicitly (`backward`): the last stage runs the loss's backward, every
other stage receives the gradient of what it sent and runs backward from it; each then sends its
input's gradient to the stage before. A training pass may run as row chunks (`microbatches`,
GPipe): forward the chunks one after another, so that stage s works on chunk i while stage s+1
works on chunk i-1, then backward chunk by chunk from the last, the same overlap in reverse. With
one chunk the stages work in turn: pp then buys memory (1/pp of the layers per rank), not speed.
Under context parallelism (`context_parallel`, set by `apply_context_parallel`) a training pass
runs this rank's positions of each row through every stage, as the whole model would.
Shape legend: B rows, T tokens, C hidden channels, V vocabulary.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..models.attention import causal_mask
from ..models.kv_cache import KVCache
from ..models.moe import MoE
from ..models.transformer import keep_stage, positions_of
from .pipeline import split_layers


class StagedModel(nn.Module):
    def __init__(self, model: nn.Module, group, pp_rank: int, pp: int):
        """`model`: the whole model, or one already loaded as this stage (`load_model(layers=...)`)."""
        super().__init__()
        self.args = model.args
        self.layers = split_layers(model.args.num_layers, pp)[pp_rank]
        keep_stage(model, self.layers)
        self.model, self.lm_head = model.model, model.lm_head
        self.group, self.pp_rank, self.pp = group, pp_rank, pp
        self.first, self.last = pp_rank == 0, pp_rank == pp - 1
        self.hidden_dtype = self.model.layers[self.layers.start].input_layernorm.weight.dtype  # what stages send
        self.share_logits = False
        self.microbatches = 1
        """Row chunks of a training pass, in flight one after another (GPipe): while one stage works on
        a chunk, the one before works on the next. 1: the whole batch at once."""
        self.chunk_group = None
        """Ranks that must split a pass alike (expert parallelism's all-to-alls pair their chunks)."""
        self.chunk_hook = None
        """Called with (first row, end row) before a chunk's forward and its backward, when a pass runs
        as several: per-row state of the layers (`lora.multi.RowAdapters`) follows the chunk, also
        through activation checkpointing's recompute."""
        self._pass: list[_Run] | None = None  # the last training pass's chunks

    @property
    def config(self):
        return self.args

    def reset_buffers(self) -> None:
        self.model.rotary_emb.reset_parameters()

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor | None:
        """Every pp rank calls it with the same arguments; logits [B, T or logits_to_keep, V] on the
        last stage (on every stage with `share_logits`), None elsewhere. A training pass (autograd
        on, no cache) runs as `microbatches` row chunks in flight one after another (GPipe)."""
        cp = getattr(self, "context_parallel", None)  # `parallel.context_parallel`: this rank's tokens of each row
        if cp is not None and cp.active:
            if attention_mask is not None or cache is not None:
                raise ValueError(
                    "under context parallelism a stage takes right-padded input_ids only (no mask or cache)"
                )
            input_ids, position_ids = cp.shard(input_ids)  # [B, t] and their global positions
        b, t = input_ids.shape
        offset = cache.length if cache is not None else 0
        if position_ids is None:
            position_ids = positions_of(input_ids, attention_mask, offset)
        training = torch.is_grad_enabled() and cache is None
        chunks = self._chunks(b) if training else 1
        runs = []
        for rows in torch.arange(b).tensor_split(chunks):
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            self._enter(lo, hi, chunks)
            runs.append(
                self._run(
                    input_ids[lo:hi],
                    None if attention_mask is None else attention_mask[lo:hi],
                    position_ids[lo:hi],
                    cache,
                    logits_to_keep,
                    (lo, hi),
                )
            )
        self._pass = runs if training else None
        logits = torch.cat([r.logits for r in runs]) if self.last else None
        if self.share_logits:  # in fp32 whatever the head computed in: every stage allocates the same
            logits = (
                logits.float()
                if self.last
                else torch.empty(b, logits_to_keep or t, self.args.vocab_size, device=input_ids.device)
            )
            dist.broadcast(logits, group=self.group, group_src=self.pp - 1)
        return logits

    def _chunks(self, rows: int) -> int:
        """Microbatches of this pass: at most one row each, and as many on every rank whose collectives
        pair up within a stage (`chunk_group`: the expert-parallel group, whose ranks hold other rows)."""
        n = torch.tensor([min(self.microbatches, rows)])
        if self.chunk_group is not None:
            dist.all_reduce(n, op=dist.ReduceOp.MIN, group=self.chunk_group)
        return int(n)

    def _enter(self, lo: int, hi: int, chunks: int) -> None:
        if self.chunk_hook is not None and chunks > 1:
            self.chunk_hook(lo, hi)

    def _run(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor,
        cache: KVCache | None,
        logits_to_keep: int,
        rows: tuple[int, int],
    ) -> _Run:
        """One batch of rows through this stage: received (or embedded), its layers, sent on (or the head)."""
        b, t = ids.shape
        if self.first:
            x = self.model.embed_tokens(ids)  # [b, T, C]
        else:
            x = torch.empty(b, t, self.args.hidden_size, dtype=self.hidden_dtype, device=ids.device)
            dist.recv(x, group=self.group, group_src=self.pp_rank - 1)
            x.requires_grad_(torch.is_grad_enabled())  # its gradient goes back to the stage before
        start = x
        offset = cache.length if cache is not None else 0
        rope = self.model.rotary_emb(positions, x.dtype)
        masks: dict[int, torch.Tensor | None] = {}
        for i in self.layers:
            window = self.model.windows[i]
            if window not in masks:
                masks[window] = causal_mask(mask, t, offset, ids.device, window)
            x = self.model.layers[i](x, rope, masks[window], cache, i)
        if cache is not None:
            cache.advance(t)
        if not self.last:
            dist.send(x.detach().contiguous(), group=self.group, group_dst=self.pp_rank + 1)
            return _Run(start, x, None, rows)
        h = self.model.norm(x)
        return _Run(start, x, self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h), rows)

    def backward(self, loss: torch.Tensor | None = None) -> None:
        """Backward of the last pass (every pp rank calls it, or none), microbatch by microbatch from
        the last: on the last stage from `loss` (its gradient at each microbatch's logits first), on
        the others from the gradient the next stage sends; each microbatch's input gradient then goes
        to the stage before at once, so the stages overlap backward as they did forward."""
        runs, self._pass = self._pass, None
        if self.last:
            grads = torch.autograd.grad(loss, [r.logits for r in runs], allow_unused=True) if len(runs) > 1 else [None]
        for i in reversed(range(len(runs))):
            run = runs[i]
            self._enter(*run.rows, len(runs))  # a recompute runs this chunk's rows again
            if self.last:
                if len(runs) == 1:
                    loss.backward()
                elif grads[i] is not None:
                    run.logits.backward(grads[i])
            else:
                grad = torch.empty_like(run.out)
                dist.recv(grad, group=self.group, group_src=self.pp_rank + 1)
                if run.out.requires_grad:  # else no adapter before here trains: nothing to compute
                    run.out.backward(grad)
            if not self.first:
                sent = run.start.grad if run.start.grad is not None else torch.zeros_like(run.start)
                dist.send(sent.contiguous(), group=self.group, group_dst=self.pp_rank - 1)

    def from_last(self, obj):
        """A Python object made on the last stage (a pass's losses and logprobs), on every stage."""
        box = [obj if self.last else None]
        dist.broadcast_object_list(box, group=self.group, group_src=self.pp - 1)
        return box[0]

    @contextlib.contextmanager
    def sharing_logits(self):
        self.share_logits = True
        try:
            yield
        finally:
            self.share_logits = False


@dataclass
class _Run:
    """One chunk of a pass on this stage: what it received, what it sent, its logits (last stage)."""

    start: torch.Tensor
    out: torch.Tensor
    logits: torch.Tensor | None
    rows: tuple[int, int]  # [first, end) of the pass's batch
