"""A pipeline stage called like the whole model: pipeline parallelism for a service.

`parallel.pipeline` trains: schedules over microbatches, next-token logprobs on the last stage.
A Tinker service asks other things of the model: logits at any targets ([N] or [N, K]), a loss it
computes itself, calls of any size one after another, and decoding with a KV cache.
`StagedModel` is this rank's part of a `CausalLM` under the model's own names
(`model.layers.3....`, so adapters, plans and saved states see the usual names), and
`staged(input_ids, attention_mask, position_ids, cache, logits_to_keep)` runs one batch through
the pp ranks in order: each receives the hidden states from the stage before, runs its layers
(keeping their keys and values in `cache`), and sends them on. The logits are the last stage's
(None elsewhere); with `share_logits` on they reach every stage (decoding: every pp rank runs the
same sampling loop and must pick the same tokens).

Backward crosses stages explicitly (`backward`): the last stage runs the loss's backward, every
other stage receives the gradient of what it sent and runs backward from it; each then sends its
input's gradient to the stage before. No microbatches, so the stages work in turn: pp buys a
service memory (each rank holds 1/pp of the layers), not speed.
Shape legend: B rows, T tokens, C hidden channels, V vocabulary.
"""

from __future__ import annotations

import contextlib

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
        self._pass: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, output) of the last pass with autograd

    @property
    def config(self):
        return self.args

    def reset_buffers(self) -> None:
        self.model.rotary_emb.reset_parameters()

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                logits_to_keep: int = 0) -> torch.Tensor | None:
        """Every pp rank calls it with the same arguments; logits [B, T or logits_to_keep, V] on the
        last stage (on every stage with `share_logits`), None elsewhere."""
        b, t = input_ids.shape
        device = input_ids.device
        offset = cache.length if cache is not None else 0
        if position_ids is None:
            position_ids = positions_of(input_ids, attention_mask, offset)
        if self.first:
            x = self.model.embed_tokens(input_ids)  # [B, T, C]
        else:
            x = torch.empty(b, t, self.args.hidden_size, dtype=self.hidden_dtype, device=device)
            dist.recv(x, group=self.group, group_src=self.pp_rank - 1)
            x.requires_grad_(torch.is_grad_enabled())  # its gradient goes back to the stage before
        start = x
        rope = self.model.rotary_emb(position_ids, x.dtype)
        masks: dict[int, torch.Tensor | None] = {}
        for i in self.layers:
            window = self.model.windows[i]
            if window not in masks:
                masks[window] = causal_mask(attention_mask, t, offset, device, window)
            x = self.model.layers[i](x, rope, masks[window], cache, i)
        if cache is not None:
            cache.advance(t)
        logits = None
        if self.last:
            h = self.model.norm(x)
            logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        else:
            dist.send(x.detach().contiguous(), group=self.group, group_dst=self.pp_rank + 1)
        self._pass = (start, x) if torch.is_grad_enabled() else None
        if self.share_logits:  # in fp32 whatever the head computed in: every stage allocates the same
            logits = logits.float() if self.last else torch.empty(b, logits_to_keep or t, self.args.vocab_size, device=device)
            dist.broadcast(logits, group=self.group, group_src=self.pp - 1)
        return logits

    def backward(self, loss: torch.Tensor | None = None) -> None:
        """Backward of the last pass (every pp rank calls it, or none): from `loss` on the last stage,
        from the gradient the next stage sends on the others; then this stage's input gradient goes
        to the stage before."""
        start, out = self._pass
        self._pass = None
        if self.last:
            loss.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, group=self.group, group_src=self.pp_rank + 1)
            if out.requires_grad:  # else no adapter before here trains: nothing to compute
                out.backward(grad)
        if not self.first:
            sent = start.grad if start.grad is not None else torch.zeros_like(start)
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
