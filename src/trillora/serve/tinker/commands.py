"""What rank 0 of a parallel service tells the other ranks to run (`policy.world`): one typed command
per service call that must run on more than one rank, broadcast before rank 0 runs it, so every
rank applies the same calls in the same order. `sharded_only`: with the base replicated, rank 0
runs that call alone (it holds every adapter); with a sharded base every rank joins it."""

from __future__ import annotations

from dataclasses import dataclass

from ..calls import SampleCall
from .types import FwdBwd


@dataclass(frozen=True)
class CreateModel:
    sid: str
    seq: int
    rank: int
    roles: tuple[str, ...]
    seed: int
    owner: str = ""
    sharded_only = False

    def run(self, s):
        s.registry.own(self.sid, self.owner)
        return s.create_model(self.sid, self.seq, self.rank, self.roles, self.seed)


@dataclass(frozen=True)
class LoadState:
    sid: str
    seq: int
    tinker_path: str
    optimizer: bool
    owner: str = ""
    sharded_only = False

    def run(self, s):
        s.registry.own(self.sid, self.owner)
        return s.load_state(self.sid, self.seq, self.tinker_path, self.optimizer)


@dataclass(frozen=True)
class ForwardBackward:
    calls: list[FwdBwd]
    sharded_only = False

    def run(self, s):
        return s.forward_backward_many(self.calls)


@dataclass(frozen=True)
class OptimStep:
    model_id: str
    adam: dict
    sharded_only = False

    def run(self, s):
        return s.optim_step(self.model_id, self.adam)


@dataclass(frozen=True)
class SaveState:
    model_id: str
    name: str
    optimizer: bool
    sharded_only = True

    def run(self, s):
        return s.save_state(self.model_id, self.name, self.optimizer)


@dataclass(frozen=True)
class SaveForSampler:
    model_id: str
    name: str | None
    sid: str | None
    sampler_seq: int
    owner: str = ""
    sharded_only = True

    def run(self, s):
        s.registry.own(self.sid or self.model_id.split(":")[0], self.owner)
        return s.save_for_sampler(self.model_id, self.name, self.sid, self.sampler_seq)


@dataclass(frozen=True)
class CreateSampler:
    sid: str
    seq: int
    model_path: str | None
    base_model: str | None
    owner: str = ""
    sharded_only = True

    def run(self, s):
        s.registry.own(self.sid, self.owner)
        return s.create_sampler(self.sid, self.seq, self.model_path, self.base_model)


@dataclass(frozen=True)
class Sample:
    calls: list[SampleCall]
    sharded_only = True

    def run(self, s):
        return s.sample_many(self.calls)


@dataclass(frozen=True)
class EndSessions:
    sids: tuple[str, ...]
    sharded_only = False

    def run(self, s):
        return s.end_sessions(list(self.sids))


@dataclass(frozen=True)
class Learn:
    """A learner's round on the experience rank 0 read from its trace store (`trainer.learner`)."""

    exp: object
    sharded_only = False

    def run(self, s):
        return s.learn(self.exp)


@dataclass(frozen=True)
class RestoreRevision:
    """A rollback: the learner goes on from revision k."""

    k: int
    sharded_only = False

    def run(self, s):
        return s.restore_revision(self.k)


@dataclass(frozen=True)
class Stop:
    """The service is closing: the other ranks leave `follow`."""

    sharded_only = False
