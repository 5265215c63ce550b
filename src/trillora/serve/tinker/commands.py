"""What rank 0 of a parallel service tells the other ranks to run (`policy.world`): one command per
service call that must run on more than one rank, broadcast before rank 0 runs it, so every rank
applies the same calls in the same order."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """`TinkerService.<method>(*args)` on the rank that receives it. `owner`: (session, key digest)
    recorded first, so the other ranks' registries bound each key alike. `sharded_only`: with the
    base replicated, rank 0 runs the call alone (it holds every adapter and revision)."""

    method: str
    args: tuple
    owner: tuple[str, str] | None = None
    sharded_only: bool = False

    def run(self, s):
        if self.owner is not None:
            s.registry.own(*self.owner)
        return getattr(s, self.method)(*self.args)


@dataclass(frozen=True)
class Stop:
    """The service is closing: the other ranks leave `follow`."""

    sharded_only = False
