"""The Tinker service on a sharded base: `torchrun ... -m trillora serve MODEL --tinker --tp T --ep K --pp P --cp C`.

The base is split as `trillora train` splits it (`parallel.dims`): N = P × dp × C × T ranks, the
decoder layers into P pipeline stages (`parallel.staged`: each rank loads and holds one stage),
the attention and dense MLP layers over the T ranks of a tensor-parallel group (which see the
same tokens; with sp the norms and the residual each hold a tp-th of them; with vocab_parallel
the head a tp-th of the vocabulary), the routed experts over K ranks borrowed from data parallelism. Every client's
adapter is split with its layers (`serve.shards`), so a large MoE's experts, its layers and the
clients' adapters cost a fraction per rank. Beyond data parallelism (`serve.tinker_dp`):

- each call's datums are split over the dp ranks; the ranks of a tp group run the same block,
  those of a cp group other positions of the same rows (`parallel.context_parallel`: every cp
  rank gets the whole rows' logprobs, so the same losses);
- every rank joins every pass, since each MoE layer's all-to-all sends routed rows to the rank
  that owns their expert and each tp layer all-reduces within its group. A rank with no datums
  of a call runs one token weighted 0. Waiting calls of several clients share a pass, each
  routed row's adapter travelling with it to its expert's rank (every rank then numbers the
  pass's adapters alike), each tp rank stacking its parts of the adapters;
- optim_step first completes the tp layers' partial gradients, then sums the dense adapters
  over dp × cp and the expert slices over the ranks holding the same experts (dp/K × cp); the clipping
  norm counts every part once;
- the stages of one dp rank run each pass in turn (with --pp-microbatches, as row chunks in
  flight); the last one computes the losses and sends the outcomes to the others, then backward
  runs from it back to the first stage;
- with fsdp the base's layers are sharded over dp × cp (FSDP2, `parallel.fsdp`) and gathered for
  each pass; the adapter slots stay outside FSDP, since each call swaps its clients' tensors in;
- saved states and sampler weights are whole (gathered) and load into any layout;
- sampling decodes whole rows (cp off) and whole logits (a vocabulary-parallel head's slices
  gathered): the tp and cp groups of rank 0 drive the engine, every member the same generate (same
  logits after the all-reduce, same seeded generator, so the same tokens). Before each forward
  rank 0 names the sampler to the rest, which run one token through the same revision so that
  their experts serve the drivers' rows. Sampler sessions therefore exist on every rank. Under
  pp the drivers are every stage of dp rank 0, and the last stage's logits reach them all.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..models.transformer import OtherStage
from ..parallel.context_parallel import apply_context_parallel
from ..parallel.dims import ParallelDims, ParallelError, build_meshes
from ..parallel.expert_parallel import apply_expert_parallel
from ..parallel.fsdp import apply_fsdp
from ..parallel.pipeline import split_layers
from ..parallel.staged import StagedModel
from ..parallel.tensor_parallel import apply_tensor_parallel
from .adapters import ResidentBase
from .shards import ExpertShard, TensorShard
from ..parallel.data_parallel import GradientSync
from .tinker_dp import DataParallelService
from .tinker_service import BadRequest


class ShardedService(DataParallelService):
    joins_every_pass = True

    def __init__(self, cfg, model=None):
        from ..checkpoint import resolve_model_path
        from ..models import load_hf_config

        args = model.args if model is not None else load_hf_config(resolve_model_path(cfg.model))[0]
        world = dist.get_world_size()
        try:
            if cfg.ep > 1 and not args.num_experts:
                raise ParallelError(f"{cfg.model} has no routed experts to shard")
            if world % (cfg.tp * cfg.pp * cfg.cp):
                raise ParallelError(f"parallel.tp={cfg.tp} × pp={cfg.pp} × cp={cfg.cp} must divide the {world} ranks")
            if cfg.pp > args.num_layers:
                raise ParallelError(f"parallel.pp={cfg.pp} stages for {args.num_layers} layers; allowed: 1..{args.num_layers}")
            dims = ParallelDims(dp=world // (cfg.tp * cfg.pp * cfg.cp), tp=cfg.tp, ep=cfg.ep, pp=cfg.pp, cp=cfg.cp,
                                fsdp=cfg.fsdp, sp=cfg.sp, vocab_parallel=cfg.vocab_parallel)  # ep must divide dp ...
            dims.check_model(args)  # ... and the experts; tp the heads, MLP widths (and the vocabulary)
        except ParallelError as e:
            raise ParallelError(f"--tp {cfg.tp} --ep {cfg.ep} --pp {cfg.pp} --cp {cfg.cp} on {world} ranks: {e}") from None
        meshes = build_meshes(dims, torch.device(cfg.device).type)
        self.dims, self.meshes, self.num_layers = dims, meshes, args.num_layers
        self.stages = None  # this rank's pipeline stage (`parallel.staged`)
        super().__init__(cfg, model)  # builds this rank's part of the base (`_resident`)
        self.dp_group, self.dp_rank, self.dp_size = meshes.group("dp"), meshes.rank("dp"), dims.dp
        self.grad_group = meshes.group("dp_cp")  # cp ranks ran other positions of the same rows
        self.edp_group = meshes.group("edp_cp")
        self.tp_group = meshes.group("tp")

    def _resident(self, path, dtype, model=None) -> ResidentBase:
        """This rank's part of the base, with its adapter slots: built on the meta device, cut to
        this rank's stage and experts, split over tp, and only then allocated and read, each rank
        reading its own part of every tensor (`checkpoint.fill_model`). A given `model` (benchmarks
        of real shapes) is split the same way after the fact."""
        from ..checkpoint import fill_model, meta_model

        dims, meshes = self.dims, self.meshes
        experts = (meshes.rank("ep"), dims.ep) if dims.ep > 1 else None
        layers = split_layers(self.num_layers, dims.pp)[meshes.rank("pp")] if dims.pp > 1 else None
        on_meta = model is None
        if on_meta:
            model = meta_model(path, dtype, experts, layers)
        if dims.pp > 1:
            model = self.stages = StagedModel(model, meshes.group("pp"), meshes.rank("pp"), dims.pp)
            self.stages.chunk_group = meshes.group("ep") if dims.ep > 1 else None
        base = ResidentBase(model, alpha=self.cfg.lora_alpha)
        placement = base.placement
        if dims.pp > 1:
            placement.stages = meshes.group("pp")
        if dims.ep > 1:
            apply_expert_parallel(model, meshes.group("ep"), meshes.rank("ep"), dims.ep)
            placement.experts = ExpertShard(meshes.group("ep"), meshes.rank("ep"), dims.ep, model.args.num_experts)
        if dims.tp > 1:
            plan = apply_tensor_parallel(model, meshes.mesh("tp"), dims.sp, dims.vocab_parallel)
            placement.tp = TensorShard.of(plan, base.slots, meshes.mesh("tp"))
        apply_context_parallel(model, meshes.group("cp"), meshes.rank("cp"), dims.cp)
        if self.cfg.fsdp:  # the base's layers over dp × cp; the adapter slots are swapped per call, so left alone
            slots = {p for name, p in model.named_parameters() if ".lora_" in name}
            # a stage's chunks run the embedding, norm and head one by one (and backward from each
            # chunk's logits): each is its own unit, gathered again for every chunk
            ends = None if self.stages is None else [m for m in (model.model.embed_tokens, model.model.norm, model.lm_head)
                                                     if not isinstance(m, OtherStage)]
            apply_fsdp(model, meshes, roots=ends, keep=slots)
        if on_meta:
            fill_model(model, path, self.cfg.device, experts)
        return base

    def lora_settings(self, base_model, lora_config):
        rank, roles, seed = super().lora_settings(base_model, lora_config)
        if self.stages is not None and set(roles) <= {"lm_head"}:
            raise BadRequest(f"lora_config trains only the unembedding, which lives on the last of --pp {self.dims.pp} "
                             "stages; every stage needs an adapter: set train_attn or train_mlp")
        return rank, roles, seed

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

    def _pass_adapters(self, live, mine):
        """Every call's adapter on every rank, in call order, with 0 rows where none of its datums
        are here: the ranks of an expert-parallel group number the adapters alike. A rank with no
        datums runs its filler token with the first. Under pp a pass (of one call or several: each
        chunk's rows keep their adapters, `RowAdapters.select_rows`) runs as `--pp-microbatches` chunks."""
        rows = [hi - lo for *_, lo, hi in live]
        if not any(rows):
            rows[0] = 1
        if self.stages is not None:
            self.stages.microbatches = self.cfg.pp_microbatches
        return [a for _, _, a, _, _ in live], rows

    def sample_many(self, calls):
        self._mirror("sample_many", calls)
        with self._decoding():
            return self._sample_or_follow(calls)

    @contextlib.contextmanager
    def _decoding(self):
        """Whole rows and whole logits on every rank that decodes: context parallelism off (every cp
        rank runs the same tokens), a vocabulary-parallel head's slices gathered over tp, and under
        pp the last stage's logits shared with every stage."""
        model = self.base.model
        cp = getattr(model, "context_parallel", None)
        with contextlib.ExitStack() as stack:
            if cp is not None:
                stack.enter_context(cp.off())
            if self.stages is not None:
                stack.enter_context(self.stages.sharing_logits())
            if self.dims.vocab_parallel and not isinstance(model.lm_head, OtherStage):
                hook = model.lm_head.register_forward_hook(lambda m, args, out: _gather_vocab(out, self.tp_group))
                stack.callback(hook.remove)
            yield

    def _sample_or_follow(self, calls):
        if self.dp_rank == 0:  # rank 0's tp group: every member drives the same generate
            hook = self.base.model.register_forward_pre_hook(self._before_forward, prepend=True)  # before FSDP gathers
            try:
                return super().sample_many(calls)
            finally:
                hook.remove()
                self._announce(None)
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        while (named := self._announce(None)) is not None:
            if isinstance(named, list):  # several revisions in the pass: the same ones, numbered alike
                revisions = [self.sampler(n) for n in named]
                use = self.base.use_many(revisions, [1] + [0] * (len(revisions) - 1))
            else:
                use = self.base.use(self.sampler(named))
            with use as model, torch.no_grad():
                model(ids)
        return []

    def _before_forward(self, module, args) -> None:
        in_use = self.base.in_use
        self._announce([r.sampler_id for r in in_use] if isinstance(in_use, tuple) else in_use.sampler_id)

    def _announce(self, sampler_id: str | list[str] | None) -> str | list[str] | None:
        """Rank 0's sampler id (or ids), on every rank (what the others pass is ignored)."""
        box = [sampler_id]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # --- passes through pipeline stages -----------------------------------------------------
    def _losses_and_backward(self, live, logps, outcomes, filler=None):
        """Under pp: the losses on the last stage, their outcomes sent to every stage, then backward
        through the stages (after the outcomes: a stage waiting for them cannot take a gradient)."""
        if self.stages is None:
            return super()._losses_and_backward(live, logps, outcomes, filler)
        total = self._kept_loss(live, logps, outcomes, filler) if self.stages.last else None
        outcomes[:], backward = self.stages.from_last((outcomes, total is not None))
        if backward:
            self.stages.backward(total)

    # --- gradients ----------------------------------------------------------------------------
    def _gradient_sync(self, params):
        """tp layers' partial sums completed; dense adapters summed over dp × cp; expert slices over the
        ranks that hold the same experts (expert parallelism already brought each of them every
        token routed to it); the norm counts replicated parts once, tp parts, expert slices and
        stages summed."""
        d, placement = self.dims, self.base.placement
        experts = {k for k in params if placement.is_expert(k)}
        return GradientSync(list(params.items()), experts, self.grad_group, self.edp_group, d.dp * d.cp, d.edp * d.cp,
                            placement.experts.group if d.ep > 1 else None, placement.stages if d.pp > 1 else None)


@torch.no_grad()
def _gather_vocab(logits_local: torch.Tensor, group) -> torch.Tensor:
    """[B, T, V/tp] slices of the head's output -> [B, T, V] on every tp rank (decoding: a few positions)."""
    parts = [torch.empty_like(logits_local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits_local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)
