"""Pipeline parallelism: the decoder cut into stages by layers, run by `torch.distributed.pipelining`.

A stage is a plain module over the model's own submodules: the first one embeds tokens, every
one runs its decoder layers, the last one applies the final norm and the head and returns
per-token logprobs and entropies [b, T-1, 2] (so only that small tensor, never the logits,
leaves the pipeline). Parameter names stay those of the whole model (`model.layers.3....`),
so adapters gather, export and compare under the usual names. Each rank keeps only its
stages' modules; the rest of the model is dropped.

Schedules (`ParallelDims.pp_schedule`): "gpipe" and "1f1b" run one stage per rank;
"interleaved_1f1b" and "interleaved_zero_bubble" two per rank in a loop (rank r: stages r and
r + pp), "zbv" two in a V (rank r: r and 2pp-1-r). The zero-bubble ones split backward into
the input gradient (sent upstream at once) and the weight gradient (filling bubbles), which
with LoRA is the adapters' gradient alone.

The loss is computed on the last stage per microbatch, from rows it looks up by index: the
schedule's "target" is the row numbers of the batch, split with the microbatches, so a
trainer's loss can use any per-row tensors (advantages, masks, old logprobs) without packing.
Losses are normalised by global token counts, so microbatch gradients add up (scale_grads off).
Shape legend: b rows, T tokens, C hidden channels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..models.attention import causal_mask
from ..models.kv_cache import KVCache
from ..models.transformer import keep_stage, positions_of
from .context_parallel import padded_length
from .dims import ParallelDims, ParallelError
from .vocab_parallel import gather_vocab, next_token_logprobs_at

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
"""`ParallelDims.pp_schedule` -> torch's schedule class (imported when a pipeline runs: torch's
pipelining imports the compiler stack, a second of every process's start that has no pp)."""


def split_layers(num_layers: int, num_stages: int, counts: tuple[int, ...] = ()) -> list[range]:
    """Layer ranges per stage: `counts` if given, else as even as possible with the extra layers
    on the middle stages (the first stage also embeds, the last one runs the head)."""
    if not counts:
        base, extra = divmod(num_layers, num_stages)
        order = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), s))  # middle stages first
        counts = tuple(base + (order.index(s) < extra) for s in range(num_stages))
    if len(counts) != num_stages or sum(counts) != num_layers:
        raise ParallelError(
            f"parallel.pp_stage_layers={list(counts)}: need {num_stages} counts summing to {num_layers}"
        )
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [range(start, start + n) for start, n in zip(starts, counts, strict=True)]


def stage_indices(pp_rank: int, dims: ParallelDims) -> list[int]:
    """The stages rank `pp_rank` runs under the schedule's placement."""
    if dims.stages_per_rank == 1:
        return [pp_rank]
    if dims.pp_schedule == "zbv":
        return [pp_rank, 2 * dims.pp - 1 - pp_rank]
    return [pp_rank, pp_rank + dims.pp]


class StageModule(nn.Module):
    """One stage: (embeddings,) decoder layers `layers`, (final norm, head, logprobs)."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.model = nn.Module()
        if first:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        self.model.rotary_emb = model.model.rotary_emb
        if last:
            self.model.norm = model.model.norm
            self.lm_head = model.lm_head
        self.temperature = 1.0
        self.vocab_group = None  # set when the head is split over the vocabulary (tp)
        self.context = None  # set under context parallelism: the stage sees this rank's tokens only
        self.decoding: tuple | None = None
        """(mask, positions, cache, logits_to_keep) while the pipeline decodes (`Pipeline.decode`): the
        call then returns hidden states or whole logits. Set around the call, not a method of its
        own, so that FSDP's hooks on this module gather its parameters as for training."""

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """x: token ids [b, T] on the first stage, hidden states [b, T or t, C] after (t: this
        context-parallel rank's tokens); tokens: the ids [b, T]."""
        if self.decoding is not None:
            return self._decode(x, tokens, *self.decoding)
        b, t = tokens.shape
        cp = self.context
        if cp is None:
            positions = torch.arange(t, device=tokens.device).expand(b, t)
        else:  # the same split on every stage: this rank's chunks of the sequence
            cp.set_length(t, tokens.device)
            positions = cp.query_positions.expand(b, -1)
            x = cp.shard(x)[0] if self.first else x
        h = self.model.embed_tokens(x) if self.first else x
        rope = self.model.rotary_emb(positions, h.dtype)
        masks: dict[int, torch.Tensor | None] = {0: None}  # right-padded rows: plain causal attention
        for layer in self.model.layers.values():
            window = 0 if cp is not None else layer.self_attn.inner.window  # cp masks by global position itself
            if window not in masks:
                masks[window] = causal_mask(None, t, 0, tokens.device, window)
            h = layer(h, rope, masks[window])
        if not self.last:
            return h
        logits = self.lm_head(self.model.norm(h))  # [b, T or t, V]
        logp, entropy = next_token_logprobs_at(logits, tokens, self.temperature, cp, self.vocab_group, True)
        return torch.stack([logp, entropy], dim=-1)  # [b, T-1, 2]

    def _decode(
        self,
        x: torch.Tensor,
        tokens: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor,
        cache: KVCache | None,
        logits_to_keep: int,
    ) -> torch.Tensor:
        """Left-padded rows after `cache`'s tokens: hidden states [b, t, C], or on the last stage the
        logits [b, logits_to_keep or t, V] (a vocabulary-parallel head's slices gathered)."""
        t = tokens.shape[1]
        offset = cache.length if cache is not None else 0
        h = self.model.embed_tokens(x) if self.first else x
        rope = self.model.rotary_emb(positions, h.dtype)
        masks: dict[int, torch.Tensor | None] = {}
        for i, layer in self.model.layers.items():
            window = layer.self_attn.inner.window
            if window not in masks:
                masks[window] = causal_mask(mask, t, offset, tokens.device, window)
            h = layer(h, rope, masks[window], cache, int(i))
        if not self.last:
            return h
        logits = self.lm_head(self.model.norm(h[:, -logits_to_keep:] if logits_to_keep else h))
        return gather_vocab(logits, self.vocab_group) if self.vocab_group is not None else logits


class Pipeline:
    """This rank's stages of `model` and the schedule that runs them with the other pp ranks."""

    def __init__(self, model: nn.Module, dims: ParallelDims, group, pp_rank: int, device: torch.device):
        self.dims, self.group, self.device, self.pp_rank = dims, group, device, pp_rank
        self.hidden_size, self.vocab_size = model.args.hidden_size, model.args.vocab_size
        self.hidden_dtype = model.model.embed_tokens.weight.dtype  # what stages send each other
        n = dims.num_stages
        ranges = split_layers(model.args.num_layers, n, dims.pp_stage_layers)
        self.stage_ids = stage_indices(pp_rank, dims)
        self.modules = [StageModule(model, ranges[s], s == 0, s == n - 1) for s in self.stage_ids]
        self.last_owner = self.owner(n - 1)  # pp rank of the head
        keep_stage(model, {i for s in self.stage_ids for i in ranges[s]}, 0 in self.stage_ids, n - 1 in self.stage_ids)

    @property
    def has_last(self) -> bool:
        return self.dims.num_stages - 1 in self.stage_ids

    def microbatches(self, rows: int) -> int:
        n = self.dims.pp_microbatches or self.dims.num_stages
        if n > rows or rows % n:
            raise ParallelError(
                f"parallel.pp_microbatches={n} does not split the {rows} rows this rank trains per "
                f"pass into equal microbatches; use a divisor of {rows} or change the batch"
            )
        return n

    def _schedule(self, shape: torch.Size, loss_fn):
        # stages and schedules are built per call: batch shapes change from step to step, and
        # a stage fixes its send/receive shapes on first use
        from torch.distributed.pipelining import PipelineStage, schedules

        n = self.microbatches(shape[0])
        stages = [
            PipelineStage(
                m,
                s,
                self.dims.num_stages,
                self.device,
                group=self.group,
                input_args=self._meta(s, shape[0] // n, shape[1], output=False),
                output_args=self._meta(s, shape[0] // n, shape[1], output=True),
            )
            for s, m in zip(self.stage_ids, self.modules, strict=True)
        ]
        cls = getattr(schedules, SCHEDULES[self.dims.pp_schedule])
        return cls(stages[0] if len(stages) == 1 else stages, n, loss_fn=loss_fn, scale_grads=False)

    def _meta(self, stage: int, m: int, t: int, output: bool) -> torch.Tensor:
        """What stage `stage` takes in or sends out per microbatch of m rows, as a meta tensor.

        Given up front, so the stages skip shape inference: that would run each later stage on
        uninitialised hidden states, and MoE routing on garbage sends garbage row counts into the
        expert-parallel all-to-all."""
        if not output and stage == 0:
            return torch.empty(m, t, dtype=torch.long, device="meta")
        if output and stage == self.dims.num_stages - 1:
            return torch.empty(m, t - 1, 2, device="meta", requires_grad=True)
        return torch.empty(
            m, self.hidden_length(t), self.hidden_size, dtype=self.hidden_dtype, device="meta", requires_grad=True
        )

    def hidden_length(self, t: int) -> int:
        """Tokens per row that cross a stage boundary: all T, or this rank's share under cp."""
        cp = self.dims.cp
        return t if cp == 1 else padded_length(t, cp) // cp

    def _set_temperature(self, temperature: float) -> None:
        for m in self.modules:
            m.temperature = temperature

    def train_step(self, input_ids: torch.Tensor, loss_of, temperature: float = 1.0) -> torch.Tensor:
        """Forward and backward of every microbatch of `input_ids` [b, T].

        `loss_of(logp [m, T-1], entropy [m, T-1], rows [m])` gives one microbatch's share of the
        loss (rows index the batch). Returns the summed loss, the same on every pp rank."""
        self._set_temperature(temperature)
        b = input_ids.shape[0]
        rows = torch.arange(b, device=input_ids.device)
        schedule = self._schedule(input_ids.shape, lambda out, r: loss_of(out[..., 0], out[..., 1], r))
        losses: list[torch.Tensor] = []
        # a new schedule's set-up clears .grad of FSDP-wrapped stages: keep what earlier calls accumulated
        params = [p for m in self.modules for p in m.parameters() if p.grad is not None]
        kept = [p.grad for p in params]
        for p in params:
            p.grad = None
        schedule.step(input_ids, tokens=input_ids, target=rows, losses=losses)
        for p, g in zip(params, kept, strict=True):
            p.grad = g if p.grad is None else p.grad + g
        total = (
            torch.stack([x.detach().float() for x in losses]).sum()
            if self.has_last
            else torch.zeros((), device=self.device)
        )
        return self._from_last(total)

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp, entropy) [b, T-1] on every pp rank, forward only: the whole batch goes through the
        stages in order (no microbatches, no autograd state to keep, so nothing to overlap)."""
        self._set_temperature(temperature)
        b, t = input_ids.shape
        x = self._walk(input_ids, self.hidden_length(t), lambda stage, x: stage(x, input_ids))
        out = self._from_last((x if self.has_last else torch.empty(b, t - 1, 2, device=self.device)).contiguous())
        return out[..., 0], out[..., 1]

    @torch.no_grad()
    def decode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Logits [b, logits_to_keep or T, V] on every pp rank for `input_ids` [b, T] after `cache`'s
        tokens: the stages in order, as `logprobs` runs them, keeping their keys and values."""
        b, t = input_ids.shape
        positions = positions_of(input_ids, attention_mask, cache.length if cache is not None else 0)

        def run(stage: nn.Module, x: torch.Tensor) -> torch.Tensor:
            stage.decoding = (attention_mask, positions, cache, logits_to_keep)
            try:
                return stage(x, input_ids)
            finally:
                stage.decoding = None

        x = self._walk(input_ids, t, run)
        if cache is not None:
            cache.advance(t)
        logits = (
            x.float() if self.has_last else torch.empty(b, logits_to_keep or t, self.vocab_size, device=self.device)
        )
        return self._from_last(logits.contiguous())

    def _walk(self, input_ids: torch.Tensor, width: int, run) -> torch.Tensor:
        """The stages this rank holds, in order, forward only: each takes the hidden states [b, width,
        H] from the rank of the stage before (or the ids), `run(stage, x)`, and sends them on; the
        last one's output (this rank's last stage's, on a rank without the last)."""
        x = input_ids
        for s in range(self.dims.num_stages):
            here = self.owner(s)
            if here != self.pp_rank:
                continue
            if s > 0 and self.owner(s - 1) != here:
                x = torch.empty(
                    input_ids.shape[0], width, self.hidden_size, dtype=self.hidden_dtype, device=self.device
                )
                dist.recv(x, group=self.group, group_src=self.owner(s - 1))
            x = run(self.modules[self.stage_ids.index(s)], x)
            if s + 1 < self.dims.num_stages and self.owner(s + 1) != here:
                dist.send(x.contiguous(), group=self.group, group_dst=self.owner(s + 1))
        return x

    def decoder(self, model: nn.Module) -> StagesDecoder:
        return StagesDecoder(self, model)

    def owner(self, stage: int) -> int:
        return next(r for r in range(self.dims.pp) if stage in stage_indices(r, self.dims))

    def share_from_last(self, obj):
        """A Python object made on the last stage (a loss's metrics), on every pp rank."""
        box = [obj if self.has_last else None]
        dist.broadcast_object_list(box, group=self.group, group_src=self.last_owner)
        return box[0]

    def _from_last(self, t: torch.Tensor) -> torch.Tensor:
        if self.dims.pp > 1:
            dist.broadcast(t, group=self.group, group_src=self.last_owner)
        return t


class StagesDecoder(nn.Module):
    """This rank's stages called like the whole model for a decoding engine (`rollout.LocalEngine`):
    `decoder(input_ids, attention_mask, cache, logits_to_keep)` -> logits on every pp rank."""

    def __init__(self, pipeline: Pipeline, model: nn.Module):
        super().__init__()
        self.pipeline, self.args = pipeline, model.args
        self.model = model.model  # the layers' places: an engine sizes its cache by them
        self.stages = nn.ModuleList(pipeline.modules)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        return self.pipeline.decode(input_ids, attention_mask, cache, logits_to_keep)
