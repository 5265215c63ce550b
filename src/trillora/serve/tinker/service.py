"""What the Tinker-compatible service does, without HTTP: sessions, training clients (each a
LoRA adapter with its own AdamW on one resident base), forward / forward_backward with the
built-in losses, optimizer steps, saved states and sampler revisions, sampling.

Every method here runs on the service's single worker (`serve.worker`), one call at a time, so the
resident model's adapter slots are never shared by two calls; the `*_many` methods serve several
waiting requests, of one client or several, in one pass with each row's own adapter. Bad requests raise
`BadRequest` (HTTP 400/404 with the message); nothing half-applied is left behind. Under torchrun
every rank runs this same class over its part of the base (`policy.world.World`: an identity in one
process); rank 0 sends each call every rank must run as a typed command (`serve.tinker.commands`).
Shape legend: B datums, T tokens (padded), V vocabulary, N one datum's tokens, K top-k targets.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ...policy import adamw
from ...policy.adapters import Revision, roles_of
from ...policy.logprobs import target_logprobs
from ...policy.policy import Policy
from ...policy.resident import resident_base
from ...policy.world import World
from ...rl.tinker_losses import datum_loss
from ...rollout.local import LocalEngine
from ...rollout.types import SamplingParams
from ..calls import BadRequest, SampleCall, check_sample
from ..config import ServeConfig
from ..registry import SERVED, Client, Registry
from ..sampling import Sampling
from ..worker import raised
from . import states
from .checks import FwdBwd, adam_settings, check_data, resolve, state_path
from .commands import Command, Stop
from .wire import Datum

__all__ = ["FwdBwd", "TinkerService"]


class TinkerService:
    def __init__(self, cfg: ServeConfig, model=None, alone: bool = False):
        """`model`: an already built model to serve instead of the checkpoint's weights (benchmarks
        of real shapes with random weights); the tokenizer still comes from `cfg.model`. Under
        torchrun (a process group initialised), this rank's part of a parallel service (`policy.world`),
        unless `alone`."""
        from ...checkpoint import check_tokenizer_fits, load_tokenizer, resolve_model_path
        from ...models import load_hf_config

        self.cfg = cfg
        self.path = path = resolve_model_path(cfg.model)
        self.tokenizer = load_tokenizer(path, trust_remote_code=cfg.trust_remote_code)
        dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
        args = model.args if model is not None else load_hf_config(path)[0]
        self.ranks = World.serving(cfg.parallel, args, torch.device(cfg.device), cfg.model, alone)
        self.writes = self.ranks.rank == 0  # saved states are written once
        self.base = resident_base(self.ranks, path, dtype, args, cfg.parallel, cfg.lora_alpha, cfg.precision, model)
        self.stages = self.ranks.stages  # this rank's pipeline stage (`parallel.staged`), under pp
        check_tokenizer_fits(self.tokenizer, self.base.model.args.vocab_size, path)
        self.device = torch.device(cfg.device)
        self.vocab = self.base.model.args.vocab_size
        self.engine = LocalEngine.sharing(self.base.model, pad_id=self.tokenizer.pad_token_id or 0)
        self.engine.max_kept_tokens = cfg.kept_kv_tokens
        self.registry = r = Registry(cfg, follower=self.ranks.rank > 0)
        # what a route asks of the registry, by the service's own names
        self.sessions, self.create_session = r.sessions, r.create_session
        self.session, self.idle_sessions = r.session, r.idle_sessions
        self.client, self.sampler, self.served, self.unserve_adapter = r.client, r.sampler, r.served, r.unserve
        self.root = Path(cfg.state_dir)
        self.learner = None
        """A learning server's learner (`--learn`, `trainer.learner`), on every rank."""
        self.sampling = Sampling(
            self.base, self.engine, self.ranks, self.tokenizer, self.device, self.check_sample, self.sampler
        )

    # --- the other ranks --------------------------------------------------------------------
    def follow(self) -> None:
        """Ranks > 0: run rank 0's commands until it says stop. A command's BadRequest is rank 0's to
        answer; here it only means the same nothing happened. Any other failure (a learner's round
        that raised, as rank 0's did) is printed, and the rank goes on following: leaving would
        take the process group from under rank 0."""
        while not isinstance(command := self.ranks.receive(), Stop):
            try:
                command.run(self)
            except BadRequest:
                pass
            except Exception as e:  # noqa: BLE001 - rank 0 answers the caller; this rank stays in step
                print(f"rank {self.ranks.rank}: {command.method}: {type(e).__name__}: {e}", file=sys.stderr)
        dist.barrier()  # with rank 0's in `stop`: no rank tears the group down while another still receives

    def stop(self) -> None:
        self.ranks.mirror(Stop())
        if self.ranks.size > 1:
            dist.barrier()

    # --- a learning server --------------------------------------------------------------------
    def learn(self, exp) -> dict:
        """A learner's round on `exp` (rank 0 read it from the trace store), on every rank."""
        self.ranks.mirror(Command("learn", (exp,)))
        return self.learner.train(exp)

    def restore_revision(self, k: int) -> None:
        """A rollback: the learner goes on from revision k, on every rank."""
        self.ranks.mirror(Command("restore_revision", (k,)))
        self.learner.restore(k)

    # --- sessions ------------------------------------------------------------------------
    def _owner(self, sid: str) -> tuple[str, str]:
        return sid, self.registry.owner(sid)

    def end_sessions(self, sids: list[str]) -> None:
        """Free sessions' training clients and samplers, on every rank (the SDK's `finish`, or an idle
        session's end); their ids answer 410 from then on."""
        self.ranks.mirror(Command("end_sessions", (sids,)))
        self.registry.end(sids)

    def check_base_model(self, name: str | None) -> None:
        if name is not None and name != self.cfg.model:
            raise BadRequest(f"unknown base_model {name!r}; this server has {self.cfg.model!r}", 404)

    def capabilities(self) -> dict:
        return {
            "supported_models": [
                {
                    "model_name": self.cfg.model,
                    "trainable": True,
                    "sampleable": True,
                    "max_context_length": self.base.model.args.max_position_embeddings,
                }
            ]
        }

    # --- training clients ----------------------------------------------------------------
    def lora_settings(self, base_model: str | None, lora_config: dict) -> tuple[int, tuple[str, ...], int]:
        """(rank, roles, seed) of a create_model request, or BadRequest naming the field."""
        self.check_base_model(base_model)
        rank = lora_config.get("rank", 32)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= self.cfg.max_rank:
            raise BadRequest(f"lora_config.rank={rank!r}; allowed: an integer in 1..{self.cfg.max_rank}")
        roles = roles_of(
            bool(lora_config.get("train_attn", True)),
            bool(lora_config.get("train_mlp", True)),
            bool(lora_config.get("train_unembed", True)),
        )
        if not roles:
            raise BadRequest("lora_config trains nothing: set one of train_attn, train_mlp, train_unembed")
        if self.stages is not None and set(roles) <= {"lm_head"}:
            raise BadRequest(
                f"lora_config trains only the unembedding, which lives on the last of --pp {self.cfg.parallel.pp} "
                "stages; every stage needs an adapter: set train_attn or train_mlp"
            )
        return rank, roles, int(lora_config.get("seed") or 0)

    def create_model(self, sid: str, seq: int, rank: int, roles: tuple[str, ...], seed: int) -> dict:
        """A new training client (settings checked by `lora_settings`)."""
        self.ranks.mirror(Command("create_model", (sid, seq, rank, roles, seed), self._owner(sid)))
        expert_rank = (
            max(1, rank // self.base.model.args.top_k) if self.cfg.expert_rank_rule == "divide_by_top_k" else None
        )
        return self.registry.register(
            sid, seq, Client("", self.base.new_adapter(rank, roles, seed, expert_rank), rank, roles)
        )

    def info(self, model_id: str) -> dict:
        c = self.client(model_id)
        return {
            "type": "get_info",
            "model_id": model_id,
            "is_lora": True,
            "lora_rank": c.rank,
            "model_name": self.cfg.model,
            "optimizer_config": {"type": "adamw"},
            "model_data": {
                "arch": self.base.model.args.model_type,
                "model_name": self.cfg.model,
                "tokenizer_id": str(Path(self.path).resolve()),
            },
        }  # loads with no hub: client and server share files

    # --- forward / backward --------------------------------------------------------------
    def forward_backward(
        self,
        model_id: str,
        loss_fn: str,
        config: dict,
        data: list[Datum],
        tensors: list[dict[str, torch.Tensor]],
        forward_only: bool,
    ):
        """Per-datum target logprobs (as `target_tokens` is shaped) and {"loss:sum": ...}; gradients
        accumulate in the client's adapter until its next optim_step (unless forward_only).
        `tensors`: each datum's loss inputs as `check_data` returned them."""
        return raised(self.forward_backward_many([FwdBwd(model_id, loss_fn, config, data, tensors, forward_only)])[0])

    def forward_backward_many(self, calls: list[FwdBwd]) -> list:
        """Several forward_backward calls (of one client or several) in ONE pass through the base,
        each call's rows with its own client's adapter; each outcome is what `forward_backward`
        returns, or the BadRequest it raises. The summed loss's backward gives each adapter exactly
        its own calls' gradients: rows never mix in a causal LM."""
        self.ranks.mirror(Command("forward_backward_many", (calls,)))
        outcomes: list = [None] * len(calls)
        live = []  # (index, call, adapter, first datum, end): the datums this process runs
        for i, c in enumerate(calls):
            try:
                adapter = self.client(c.model_id).adapter
            except BadRequest as e:
                outcomes[i] = e
                continue
            live.append((i, c, adapter, *self.ranks.block(len(c.data))))
        mine = [x for x in live if x[4] > x[3]]
        if not mine and not (self.ranks.sharded and live):  # a sharded rank joins every pass (its collectives)
            self._losses_and_backward(live, [], outcomes)
            return outcomes
        adapters, rows = self.ranks.pass_adapters(live, mine)
        use = self.base.use(adapters[0]) if len(adapters) == 1 else self.base.use_many(adapters, rows)
        with use as model, torch.set_grad_enabled(any(not c.forward_only for _, c, *_ in live)):
            if not mine:  # one token through the pass, weighted 0: its collectives, not its loss
                filler = self._target_logprobs(model, [Datum([0], {})], [{"target_tokens": torch.zeros(1)}])[0]
                self._losses_and_backward(live, [], outcomes, filler)
                return outcomes
            logps = self._target_logprobs(
                model,
                [d for _, c, _, lo, hi in mine for d in c.data[lo:hi]],
                [t for _, c, _, lo, hi in mine for t in c.tensors[lo:hi]],
            )
            self._losses_and_backward(live, logps, outcomes)
        return outcomes

    def _losses_and_backward(
        self, live: list, logps: list[torch.Tensor], outcomes: list, filler: torch.Tensor | None = None
    ) -> None:
        """Under pp the losses are the last stage's; their outcomes go to every stage, then backward runs
        through the stages (after the outcomes: a stage waiting for them cannot take a gradient)."""
        if self.stages is None:
            total = self._kept_loss(live, logps, outcomes, filler)
            if total is not None:
                total.backward()
            return
        total = self._kept_loss(live, logps, outcomes, filler) if self.stages.last else None
        outcomes[:], backward = self.stages.from_last((outcomes, total is not None))
        if backward:
            self.stages.backward(total)

    def _kept_loss(
        self, live: list, logps: list[torch.Tensor], outcomes: list, filler: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Each call's loss over its datums (`logps` in call order) and its outcome; a non-finite one is
        refused. Returns the sum of the kept losses, to run backward from (None: nothing to run).
        `filler` (a pass's output, weighted 0) joins the first call's loss."""
        partial, start, mine = [], 0, {}
        for i, c, _, lo, hi in live:
            lps, start = logps[start : start + hi - lo], start + hi - lo
            mine[i] = lps
            partial.append(
                sum(
                    (
                        datum_loss(c.loss_fn, lp, {k: v.to(self.device) for k, v in t.items()}, c.config)
                        for lp, t in zip(lps, c.tensors[lo:hi], strict=True)
                    ),
                    torch.zeros((), device=self.device),
                )
            )
        if filler is not None:
            partial[0] = partial[0] + filler.sum() * 0
        totals, every = self.ranks.combine(partial, mine, self.device)
        kept = []
        for (i, c, *_), loss, total in zip(live, partial, totals, strict=True):
            if not c.forward_only and not math.isfinite(total):
                outcomes[i] = BadRequest(f"the {c.loss_fn} loss is not finite ({total}): check logprobs and advantages")
                continue
            if not c.forward_only and loss.requires_grad:
                kept.append(loss)
            outcomes[i] = (every[i], {"loss:sum": total})
        return torch.stack(kept).sum() if kept else None

    def check_data(self, loss_fn: str, config: dict, data: list[Datum]) -> list[dict[str, torch.Tensor]]:
        """Each datum's loss inputs as tensors, or BadRequest naming the datum and key."""
        return check_data(loss_fn, config, data, self.vocab, self.base.model.args.max_position_embeddings)

    def _target_logprobs(self, model, data: list[Datum], tensors) -> list[torch.Tensor]:
        width = max(len(d.tokens) for d in data)
        # [B, T] right-padded (causal: pads change nothing before them)
        ids = torch.zeros(len(data), width, dtype=torch.long)
        for i, d in enumerate(data):
            ids[i, : len(d.tokens)] = torch.tensor(d.tokens)
        logits = model(ids.to(self.device))  # [B, T, V]; under cp [B, t, V]; with a vocabulary-parallel head [.., V/tp]
        if logits is None:  # a pipeline stage before the last: the last one computes the losses
            return [None] * len(data)
        return target_logprobs(
            logits,
            [t["target_tokens"].long().to(self.device) for t in tensors],  # [N] or [N, K]
            getattr(model, "context_parallel", None),
            getattr(model, "vocab_parallel_group", None),
        )

    def optim_step(self, model_id: str, adam: dict) -> dict:
        """One AdamW step on the accumulated gradients (`Policy.optim_step`)."""
        self.ranks.mirror(Command("optim_step", (model_id, adam)))
        client = self.client(model_id)
        lr, b1, b2, eps, wd, clip = adam_settings(adam)  # refused before the gradients are summed: a retry sums once
        a = client.adapter
        self.ranks.join_gradients(list(a.params.values()))
        settings = {"lr": lr, "betas": (b1, b2), "eps": eps, "weight_decay": wd}
        a.optimizer = a.optimizer or adamw(a.params.values(), **settings)
        for g in a.optimizer.param_groups:
            g.update(settings)
        outcome, _ = Policy.of_adapter(self.base, self.ranks, a).optim_step(clip)  # the client's adapter as a Policy
        if not outcome.stepped:  # a NaN never reaches the adapter
            raise BadRequest("the accumulated gradient is not finite; the step was dropped")
        a.steps += 1
        return {"metrics": {"grad_norm:mean": outcome.norm}}

    # --- saved states --------------------------------------------------------------------
    def state_path(self, model_id: str, kind: str, name: str) -> tuple[str, Path]:
        return state_path(self.root, model_id, kind, name)

    def resolve(self, tinker_path: str) -> tuple[str, str, Path]:
        return resolve(self.root, tinker_path)

    def save_state(self, model_id: str, name: str, optimizer: bool = True) -> dict:
        self.ranks.mirror(Command("save_state", (model_id, name, optimizer), sharded_only=True))
        return states.save_state(self, model_id, name, optimizer)

    def load_state(self, sid: str, seq: int, tinker_path: str, optimizer: bool) -> dict:
        """A new training client from a saved state (with its AdamW moments when `optimizer`)."""
        self.ranks.mirror(Command("load_state", (sid, seq, tinker_path, optimizer), self._owner(sid)))
        return states.load_state(self, sid, seq, tinker_path, optimizer)

    def save_for_sampler(self, model_id: str, name: str | None, sid: str | None = None, sampler_seq: int = 0) -> dict:
        """A frozen revision: named ones are written as tinker://.../sampler_weights/<name>; unnamed
        ones become a sampling session at once."""
        owner = self._owner(sid or model_id.split(":")[0])
        self.ranks.mirror(Command("save_for_sampler", (model_id, name, sid, sampler_seq), owner, sharded_only=True))
        return states.save_for_sampler(self, model_id, name, sid, sampler_seq)

    # --- sampling ------------------------------------------------------------------------
    def create_sampler(self, sid: str, seq: int, model_path: str | None, base_model: str | None) -> str:
        self.ranks.mirror(Command("create_sampler", (sid, seq, model_path, base_model), self._owner(sid), True))
        if model_path is None:
            self.check_base_model(base_model)
            return self.registry.add_sampler(sid, seq, Revision(None))
        _, kind, folder = self.resolve(model_path)
        saved = states.saved_state(folder, kind, model_path)
        config = states.slot_config(self, saved.lora, model_path)
        tensors = {k[len("param.") :]: v for k, v in saved.tensors.items() if k.startswith("param.")} or saved.tensors
        tensors = {
            k: self.base.placement.shard(k, v.to(self.device)) for k, v in self.base.placement.here(tensors).items()
        }
        return self.registry.add_sampler(sid, seq, Revision(config, tensors))

    def serve_adapter(self, name: str, revision: Revision) -> None:
        """The OpenAI routes' `load_lora_adapter`: `revision` served as `name` (replacing one of that name)."""
        self.registry.add_sampler(SERVED, name, revision)

    def sample(self, sampler_id: str, prompt: list[int], n: int, params: dict, prompt_logprobs: bool):
        """n sequences of (tokens, logprobs, stop reason), and the prompt's logprobs when asked."""
        return raised(self.sample_many([SampleCall(sampler_id, prompt, n, params, prompt_logprobs)])[0])

    def sample_many(self, calls: list[SampleCall]) -> list:
        """Several sample calls; those with the same settings (n, sampling params, no prompt logprobs,
        no seed unless they are one request's prompts) share one `generate`, each prompt with its own
        sampler's revision. Each outcome is what `sample` returns, or the BadRequest it raises."""
        self.ranks.mirror(Command("sample_many", (calls,), sharded_only=True))
        return self.sampling.run(calls)

    def check_sample(self, c: SampleCall) -> tuple[Revision, SamplingParams, tuple[str, ...]]:
        revision = self.sampler(c.sampler_id)
        return (
            revision,
            *check_sample(
                c, self.vocab, self.tokenizer.eos_token_id, self.cfg, self.base.model.args.max_position_embeddings
            ),
        )
