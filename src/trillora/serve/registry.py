"""Who holds what on a service: Tinker sessions, their training clients and samplers, and the
OpenAI routes' served revisions (the SERVED session), with the caps that keep them bounded.

Ids are random (`session-<16 characters>`), and a session's models and samplers are named after
it (`<session>:train:<n>`, `<session>:sample:<n>`), so an id is the right to use it. A session
not heard from for `session_seconds` is idle; ended sessions free everything they held, and
their ids answer 410 (the SDK stops its heartbeat on it). The registry changes no model: the
service mirrors what every rank must do (`serve.tinker.commands`) and then records it here.
"""

from __future__ import annotations

import collections
import secrets
import threading
import time
from dataclasses import dataclass, field

from ..policy.adapters import Adapter, Revision
from .calls import BadRequest
from .config import ServeConfig


@dataclass
class Client:
    model_id: str
    adapter: Adapter
    rank: int
    roles: tuple[str, ...]


@dataclass
class Session:
    session_id: str
    owner: str = ""
    """The digest of the key that opened it (`http.owner_of`): what it holds counts against that key's share."""
    models: dict[str, Client] = field(default_factory=dict)
    samplers: dict[str, Revision] = field(default_factory=dict)
    ephemeral: set[str] = field(default_factory=set)
    """Its samplers made from unnamed revisions (the first to go when samplers run out)."""
    seen: float = field(default_factory=time.monotonic)
    """When the session was last heard from (a heartbeat or any call naming it)."""


SERVED = "served"
"""The session that holds the OpenAI routes' revisions, by model name (no Tinker client reaches it)."""


class Registry:
    def __init__(self, cfg: ServeConfig, follower: bool):
        """`follower`: a rank > 0, where sessions exist once a command names them (rank 0 opened
        them on its HTTP threads)."""
        self.cfg, self.follower = cfg, follower
        self.sessions: dict[str, Session] = {SERVED: Session(SERVED)}
        self.ended: collections.deque[str] = collections.deque(maxlen=4096)
        self.lock = threading.Lock()
        base = Revision(None, sampler_id=f"{SERVED}:sample:{cfg.model}")
        self.sessions[SERVED].samplers[base.sampler_id] = base
        self.aliases: dict[str, str] = {}
        """Served names that stand for another (a learner's `name` → its current `name@k`)."""

    def create_session(self, owner: str = "") -> str:
        """`owner`: the opening key's digest; with several keys each holds at most its share."""
        with self.lock:
            if len(self.sessions) - 1 >= self.cfg.max_sessions:
                raise BadRequest(
                    f"the server holds {self.cfg.max_sessions} sessions (--max-sessions); finish one, "
                    f"or wait {self.cfg.session_seconds:.0f} s for an idle one to end",
                    429,
                )
            if over := self._over_share(owner, lambda s: 1, self.cfg.max_sessions, "sessions"):
                raise BadRequest(over, 429)
            sid = f"session-{secrets.token_urlsafe(12)}"
            self.sessions[sid] = Session(sid, owner)
        return sid

    def owner(self, sid: str) -> str:
        """Whose session `sid` is ("" if none): the commands that fill a session carry it to the other ranks."""
        return getattr(self.sessions.get(sid), "owner", "")

    def own(self, sid: str, owner: str) -> None:
        """A follower learns whose session `sid` is, so that its shares decide as rank 0's did."""
        if self.follower and sid != SERVED:
            self.session(sid).owner = owner

    def _over_share(self, owner: str, count, cap: int, what: str) -> str | None:
        """Why `owner` may hold no more (its sessions hold its share of `cap`, `count(session)` each), or
        None: with several keys an even share, so that no key locks the others (the operator's among
        them) out. Every rank decides alike: a follower's sessions carry their owner (`own`)."""
        keys = self.cfg.key_count()
        if keys < 2:
            return None
        held = sum(count(s) for k, s in self.sessions.items() if k != SERVED and s.owner == owner)
        if held < max(1, cap // keys):
            return None
        return f"this key holds {held} {what}, its share of the server's {cap} ({keys} keys)"

    def session(self, sid: str) -> Session:
        if self.follower:
            with self.lock:
                return self.sessions.setdefault(sid, Session(sid))
        s = self.sessions.get(sid)
        if s is None:
            ended = sid in self.ended
            raise BadRequest(
                f"session_id {sid!r} has ended" if ended else f"unknown session_id {sid!r}", 410 if ended else 404
            )
        s.seen = time.monotonic()
        return s

    def idle_sessions(self) -> list[str]:
        now = time.monotonic()
        with self.lock:
            return [k for k, s in self.sessions.items() if k != SERVED and now - s.seen > self.cfg.session_seconds]

    def end(self, sids: list[str]) -> None:
        with self.lock:
            for sid in sids:
                if sid != SERVED and self.sessions.pop(sid, None) is not None:
                    self.ended.append(sid)

    def _find(self, key: str, table: str, what: str):
        """A session's client or sampler by its id (which names the session); the session was heard from."""
        session = self.sessions.get(key.split(":")[0], Session(""))
        found = getattr(session, table).get(key)
        if found is None:
            raise BadRequest(f"unknown {what} {key!r}", 404)
        session.seen = time.monotonic()
        return found

    def client(self, model_id: str) -> Client:
        return self._find(model_id, "models", "model_id")

    def register(self, sid: str, seq: int, client: Client) -> dict:
        session = self.session(sid)
        with self.lock:
            client.model_id = f"{sid}:train:{seq}"
            if client.model_id in session.models:
                raise BadRequest(f"model_seq_id {seq} of this session is taken by {client.model_id!r}", 409)
            if sum(len(s.models) for s in self.sessions.values()) >= self.cfg.max_clients:
                raise BadRequest(
                    f"the server holds {self.cfg.max_clients} training clients (--max-clients); "
                    "finish a session to free its clients",
                    429,
                )
            if over := self._over_share(
                session.owner, lambda s: len(s.models), self.cfg.max_clients, "training clients"
            ):
                raise BadRequest(over, 429)
            session.models[client.model_id] = client
        return {"model_id": client.model_id, "type": "create_model"}

    def add_sampler(self, sid: str, seq: int | str, revision: Revision, ephemeral: bool = False) -> str:
        """`ephemeral`: an unnamed revision (`save_weights_and_get_sampling_client`, once per RL step).
        At the cap, the session's oldest ephemeral one makes room (a recipe samples with its newest;
        the same one on every rank: creation order), else 429."""
        session = self.session(sid)
        sampler_id = revision.sampler_id = f"{sid}:sample:{seq}"
        with self.lock:
            held = sum(len(s.samplers) for k, s in self.sessions.items() if k != SERVED)
            if sid != SERVED and sampler_id not in session.samplers:
                over = self._over_share(session.owner, lambda s: len(s.samplers), self.cfg.max_samplers, "samplers")
                if held >= self.cfg.max_samplers:
                    over = (
                        f"the server holds {self.cfg.max_samplers} samplers (--max-samplers); "
                        "finish a session to free its samplers"
                    )
                if over:  # the session's oldest unnamed sampler makes room, else 429
                    oldest = next((k for k in session.samplers if k in session.ephemeral), None)
                    if oldest is None:
                        raise BadRequest(over, 429)
                    del session.samplers[oldest]
                    session.ephemeral.discard(oldest)
            session.samplers.pop(sampler_id, None)  # a replaced one counts as new: it goes last
            session.ephemeral.discard(sampler_id)
            session.samplers[sampler_id] = revision
            if ephemeral:
                session.ephemeral.add(sampler_id)
        return sampler_id

    def sampler(self, sampler_id: str) -> Revision:
        return self._find(sampler_id, "samplers", "sampling_session_id")

    def publish(self, name: str, k: int, revision: Revision, keep: int) -> None:
        """A learner's revision k served as `name@k` and `name` pointed at it; those `keep` or more
        before it let go (every rank of a service does the same: `serve.revisions`)."""
        self.add_sampler(SERVED, f"{name}@{k}", revision)
        with self.lock:
            self.aliases[name] = f"{name}@{k}"
            held = self.sessions[SERVED].samplers
            for old in [j for j in range(k - keep + 1) if f"{SERVED}:sample:{name}@{j}" in held]:
                del held[f"{SERVED}:sample:{name}@{old}"]

    def unserve(self, name: str) -> None:
        with self.lock:
            if name == self.cfg.model or self.sessions[SERVED].samplers.pop(f"{SERVED}:sample:{name}", None) is None:
                raise BadRequest(f"no adapter named {name!r}", 404)

    def served(self) -> dict[str, Revision]:
        """The OpenAI routes' models: the base's name first, then each loaded adapter's; an alias
        maps to its target's revision (a request takes that revision's id when it arrives)."""
        with self.lock:
            out = {k.split(":", 2)[2]: r for k, r in self.sessions[SERVED].samplers.items()}
            out.update({a: out[t] for a, t in self.aliases.items() if t in out})
            return out
