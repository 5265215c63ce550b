"""The online learner of `trillora serve MODEL --record STORE --learn CONFIG`: the served policy
trained on its own rewarded traffic, in its own adapter slot of the resident base.

Each round (`step`, run on the server's one compute thread, between served requests):

    experience = traces.collect(store)     untrained rewarded traces → sequences + advantages
    batch      = the sequences, with the logprobs recorded at serving as the rollout logprobs
    metrics    = PolicyUpdate(batch)       the trainer's own update: proximal pass, truncated
                                           importance weights of the learner vs the recorded
                                           behaviour (algorithm.mismatch), clip, KL, AdamW
    publish(revision k + 1)                new requests get it; requests in flight finish on theirs

The update is `trillora train`'s (`trainer.update.PolicyUpdate`, a client of `policy.Policy`), on a
world of one or on a parallel server's ranks (every rank runs each round), so the
off-policy gap of traffic served by an older revision is corrected by the same importance
weights, masks and metrics (`is_ratio_*`) as the gap between an engine and the trainer. Every
published revision is written (adapter and AdamW state, atomically) under the state folder, and
a restarted server's learner resumes from the newest one.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..checkpoint.train_state import state_meta
from ..errors import ConfigError
from ..parallel import ParallelDims
from ..policy import adamw
from ..policy.policy import Policy
from ..policy.world import World
from ..traces.experience import Baselines, Experience, collect, reward_function
from ..traces.types import HELD_OUT
from .batch import batch_from_samples
from .gates import make_gate
from .update import PolicyUpdate


def check_parallel(cfg) -> None:
    """What a learner on several ranks cannot do yet, refused by name: learn.gate samples with the
    revision on one process, and a round's rows split unevenly over the ranks (micro-batches of
    `parallel.micro_batch_rows`, or `parallel = "auto"`'s, would give them different numbers of passes)."""
    if cfg.learn.gate or cfg.parallel.micro_batch_rows or cfg.parallel.auto:
        raise ConfigError(
            '--learn under torchrun: leave learn.gate, parallel.micro_batch_rows and parallel = "auto" '
            "unset (a gate samples on one process; a round's rows split unevenly over the ranks), or "
            "serve in one process"
        )


class Learner:
    def __init__(
        self,
        base,
        store,
        cfg,
        publish: Callable[[int, dict[str, torch.Tensor], object], None],
        folder: str | Path,
        device: torch.device,
        tokenizer=None,
        owners: set[str] | None = None,
        world: World | None = None,
    ):
        """`base`: the service's resident base (`use`, `new_adapter`); `store`: the trace store (rank
        0's; None on the other ranks); `cfg`: a TrainConfig (its lora, optim, algorithm, rollout,
        learn and, for the gate, task sections); `publish(k, tensors, config)`: serve revision k;
        `owners`: the keys (digests) whose traces train (None: every key's, `learn.from_keys`);
        `world`: the service's ranks under torchrun (every rank runs each round, rank 0's
        experience in hand: `TinkerService.learn`), None in one process."""
        self.base, self.store, self.cfg, self.publish, self.owners = base, store, cfg, publish, owners
        self.folder, self.device, self.tokenizer = Path(folder), device, tokenizer
        self.pad_id = (tokenizer.pad_token_id or 0) if tokenizer is not None else 0
        world = world if world is not None else World(0, 1, ParallelDims(dp=1, fsdp=False), None, device)
        if world.size > 1:
            check_parallel(cfg)
        lc, o = cfg.lora, cfg.optim
        self.adapter = base.new_adapter(lc.rank, tuple(lc.targets), cfg.seed, lc.expert_rank)
        params = self.adapter.params
        self.adapter.optimizer = adamw(params.values(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
        self.world = world
        self.policy = Policy.of_adapter(base, world, self.adapter)
        self.update = PolicyUpdate(self.policy, cfg)
        self.update.uneven = world.size > 1  # one process keeps the trainer's split, bit for bit
        self.baselines = Baselines(cfg.learn.baseline_decay)
        self.score = reward_function(cfg.learn.reward)
        self.revision = 0
        """The newest published revision (0: none yet, the base or loaded adapter serves)."""
        self.history: list[dict] = []
        self.best: float | None = None
        """The best gate score of a published revision, on `best_basis` (what the gate measured)."""
        self.best_basis = ""
        self.gate = make_gate(self) if cfg.learn.gate else None
        self.last_round = time.monotonic()
        self._resume()

    # --- persistence --------------------------------------------------------------------------
    def _resume(self) -> None:
        """The newest revision written by an earlier server, back in the slot and published."""
        saved = sorted(self.folder.glob("revision-*"), key=lambda p: int(p.name.split("-")[1]))  # none: no folder
        if not saved:
            return
        last = saved[-1]
        state = last / "state.json"  # a revision's state (learner.json: written before revisions were states)
        meta = (
            json.loads(state.read_text())["learner"]
            if state.is_file()
            else json.loads((last / "learner.json").read_text())
        )
        self.policy.load(self._mine(last), last)
        self.revision, self.history, self.baselines.means = meta["revision"], meta["history"], meta["baselines"]
        self.best, self.best_basis = meta.get("best"), meta.get("best_basis", "")
        self.publish(self.revision, {k: t.clone() for k, t in self.adapter.tensors().items()}, self.adapter.config)

    def _mine(self, folder: Path) -> dict[str, torch.Tensor]:
        """This rank's part of a saved revision's tensors (all of them in one process)."""
        placement = self.base.placement
        return placement.local(placement.here(load_file(str(folder / "adapter.safetensors"))))

    def _save(self) -> None:
        """Revision k as one saved state (`Policy.save`): a Tinker client or a run can start from it."""
        learner = {"revision": self.revision, "history": self.history, "baselines": self.baselines.means}
        learner |= {"best": self.best, "best_basis": self.best_basis}
        meta = state_meta(self.adapter.config, self.policy.steps, self.adapter.optimizer, learner=learner)
        self.policy.save(self.folder / f"revision-{self.revision}", meta)

    def _prune(self) -> None:
        """Once the new revision is served: the last `keep` stay on disk, as they stay servable."""
        for old in [] if not self.world.main else self.folder.glob("revision-*"):
            if int(old.name.split("-")[1]) <= self.revision - self.cfg.learn.keep:
                shutil.rmtree(old, ignore_errors=True)

    def restore(self, k: int) -> None:
        """Go on from revision k (a rollback): its adapter and AdamW state back in the slot."""
        folder = self.folder / f"revision-{k}"
        self.policy.load(self._mine(folder), folder)

    # --- a round ------------------------------------------------------------------------------
    def due(self) -> bool:
        """Enough new rewarded traces for a round, or `learn.minutes` since the last with at least one
        (cheap: no model work)."""
        new, learn = self.store.untrained_count(rewarded_only=self.score is None), self.cfg.learn
        waited = learn.minutes > 0 and time.monotonic() - self.last_round >= 60 * learn.minutes
        return new >= max(learn.every, self.fewest) or (new >= self.fewest and waited)

    @property
    def fewest(self) -> int:
        """Sequences a round needs: under torchrun one per data-parallel rank and minibatch (a rank
        with no row would hold the others' collectives)."""
        return self.cfg.algorithm.minibatches * self.world.dims.dp if self.world.size > 1 else 1

    def step(self) -> dict | None:
        """One round: `train(prepare())`. None when there was nothing to train on."""
        exp = self.prepare()
        return self.train(exp) if exp is not None else None

    def prepare(self) -> Experience | None:
        """The round's experience, read from the store (no model work: a server runs this off its
        compute thread, so reading the store never holds a served request). None when every new
        trace was left out (and counted)."""
        self.last_round = time.monotonic()
        exp = collect(
            self.store,
            self.revision,
            self.cfg.learn,
            self.cfg.rollout.temperature,
            self.baselines,
            self.score,
            self.base.model.args.vocab_size,
            self.owners,
        )
        if exp.left_out:
            self.store.mark_trained(exp.left_out, -1)
        if exp.held_out:
            self.store.mark_trained(exp.held_out, HELD_OUT)
        return exp if exp.samples else None

    def train(self, exp: Experience) -> dict:
        """The round's model work, on the compute thread: the update, the gate, the next revision
        written and published."""
        start = time.perf_counter()
        if len(exp.samples) < self.fewest:
            self._mark(exp.trace_ids, -1)  # left out: a data-parallel rank with no row would hold the others
            return None
        batch = batch_from_samples(exp.samples, self.pad_id, self.device)
        batch = dataclasses.replace(batch, advantages=torch.tensor(exp.advantages, device=self.device))
        with self.base.use(self.adapter):
            metrics = self.update(batch)
        if metrics.get("skipped_update"):  # a non-finite loss or gradient: a NaN never reaches a served revision
            self._mark(exp.trace_ids, -1)  # consumed: the same batch would fail again
            if self.revision:
                self.restore(self.revision)
            return {"revision": self.revision, "skipped": True, "traces": len(exp.trace_ids), **metrics}
        lag = [self.revision - k for k in exp.revisions]
        row = {
            "revision": self.revision + 1,
            "traces": len(exp.trace_ids),
            "sequences": len(exp.samples),
            "reward_mean": sum(exp.rewards) / len(exp.rewards),
            "served_by_max_lag": max(lag),
            **{f"dropped_{k}": v for k, v in exp.dropped.items()},
            **metrics,
        }
        checked = self.gate() if self.gate is not None else None  # None: nothing held out to judge by yet
        if checked is not None:
            score, basis = checked
            row["gate_score"] = score
            if basis != self.best_basis:  # measured on other held-out traces: a new bar
                self.best, self.best_basis = None, basis
            if self.best is not None and score < self.best - self.cfg.learn.gate_tolerance:
                self._mark(exp.trace_ids, -1)  # consumed: a revision that failed its check is not retried
                if self.revision:
                    self.restore(self.revision)
                return {**row, "revision": self.revision, "gated": True, "seconds": time.perf_counter() - start}
            self.best = score if self.best is None else max(self.best, score)
        self.revision += 1
        row.update(seconds=time.perf_counter() - start, time=time.time())
        self.history.append(row)
        self._save()  # on disk before it is served: a restart resumes from what was published
        self._mark(exp.trace_ids, self.revision)
        self.publish(self.revision, {k: t.clone() for k, t in self.adapter.tensors().items()}, self.adapter.config)
        self._prune()
        return row

    def _mark(self, trace_ids, revision: int) -> None:
        """The store's record of what a round did with its traces (rank 0 holds the store)."""
        if self.store is not None:
            self.store.mark_trained(trace_ids, revision)
