"""The Tinker service's futures: an operation that computes is queued on the worker and answered
with an id at once; `retrieve_future` holds the poll on the event loop (no thread) until the
outcome is there or `poll_seconds` pass (`try_again`). A retrieved outcome is released; one not
retrieved within an hour is dropped, and so are a key's oldest unread outcomes once they hold
more than `max_unread_bytes` together (a sample with top-k logprobs is 16 MiB: a client that never
reads could hold the server's memory)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import secrets
import threading
import time
from dataclasses import dataclass, field

from ..calls import BadRequest
from ..worker import Job, Replayed, Worker, wait_for

PROTO = "application/x-protobuf"
MAX_WAITING = 4


@dataclass
class Future:
    done: asyncio.Event = field(default_factory=asyncio.Event)
    """Set on the event loop once `body` holds the outcome."""
    body: bytes = b""
    proto: bool = False
    created: float = field(default_factory=time.monotonic)
    owner: str = ""
    """The digest of the key that queued it (`http.owner_of`)."""
    settled: float | None = None
    """When `body` came to hold the outcome (set on the worker; `done` follows on the event loop)."""


class Futures:
    def __init__(self, worker: Worker, poll_seconds: float, max_unread_bytes: int = 1 << 30, max_held: int = 1024):
        self.worker, self.poll_seconds, self.max_unread_bytes = worker, poll_seconds, max_unread_bytes
        self.max_held = max_held
        self.futures: dict[str, Future] = {}
        self.held: collections.Counter[str] = collections.Counter()
        """Futures per key, queued or not yet retrieved (20,000 one-token samples held the worker 427 s)."""
        self.waiting: collections.Counter[str] = collections.Counter()  # `now` calls per key
        self.unread: dict[str, dict[str, None]] = collections.defaultdict(dict)
        """Per key, the ids whose outcome is there and not yet retrieved, oldest first."""
        self.dropped: collections.deque[str] = collections.deque(maxlen=4096)
        """Ids whose unread outcome made room for a newer one (answered 410, not 404)."""
        self.lock = threading.Lock()  # routes run on the threadpool
        self.loop: asyncio.AbstractEventLoop | None = None  # the HTTP layer's, where futures are settled

    def start(
        self,
        owner: str,
        fn,
        proto: bool = False,
        model_id: str | None = None,
        seq_id: int | None = None,
        fuse: str | None = None,
        payload=None,
        encode=json.dumps,
    ) -> dict:
        """Queue `fn` (a result that `encode` makes bytes or text of) for `owner`; the future's id.
        `fuse`/`payload`: the kind of request and what its fuser needs, to share a pass."""
        with self.lock:  # an id no other client can guess: whoever holds it may read the result
            old = [k for k, f in self.futures.items() if f.done.is_set() and time.monotonic() - f.created > 3600]
            for k in old:
                self._forget(k)
            if self.held[owner] >= self.max_held:
                raise BadRequest(
                    f"this key holds {self.held[owner]} requests not yet retrieved (--max-futures); "
                    "retrieve their results first",
                    429,
                )
            rid = f"req-{secrets.token_urlsafe(16)}"
            fut = self.futures[rid] = Future(proto=proto, owner=owner)
            self.held[owner] += 1

        def settle(out) -> None:
            if not isinstance(out, Exception):
                try:
                    body = encode(out)
                    fut.body = body.encode() if isinstance(body, str) else body
                except Exception as e:  # noqa: BLE001 - settled as the request's error; the worker goes on
                    out = e
            if isinstance(out, Exception):  # a server fault still answers the poll, with what went wrong
                user = isinstance(out, BadRequest)
                error = str(out) if user else f"{type(out).__name__}: {out}"
                fut.body = json.dumps({"error": error, "category": "user" if user else "server"}).encode()
                fut.proto = False
            with self.lock:
                fut.settled = time.monotonic()
                if rid in self.futures:
                    self.unread[owner][rid] = None
            self._bound(owner)
            with contextlib.suppress(RuntimeError):  # the server has stopped: no poll is waiting any more
                self.loop.call_soon_threadsafe(fut.done.set)

        try:
            self.worker.submit(Job(fn, settle, model_id, fuse, payload, owner=owner), seq_id)
        except Replayed as e:
            with self.lock:
                self._forget(rid)
            raise BadRequest(str(e), 409) from None
        return {"request_id": rid, **({"model_id": model_id} if model_id else {})}

    def _bound(self, owner: str) -> None:
        """Drop `owner`'s oldest unread outcomes while they hold more than `max_unread_bytes`: only
        those left unread for `poll_seconds` (a client that polls has read its own by then), never its
        newest. One budget for all clients of a server without keys."""
        with self.lock:
            unread = [(k, self.futures[k]) for k in self.unread[owner]]
            total, now = sum(len(f.body) for _, f in unread), time.monotonic()
            for rid, f in unread[:-1]:  # oldest first
                if total <= self.max_unread_bytes:
                    break
                if now - f.settled < self.poll_seconds:
                    continue
                total -= len(f.body)
                self._forget(rid)
                self.dropped.append(rid)

    def _forget(self, rid: str) -> None:
        """Release a future (retrieved, dropped, expired or refused); under `lock`."""
        fut = self.futures.pop(rid, None)
        if fut is not None:
            self.held[fut.owner] -= 1
            self.unread[fut.owner].pop(rid, None)

    def now(self, fn, owner: str = ""):
        """`fn`'s result (or the error it raised), run on the worker between requests: calls that
        answer at once still change the model's state only there (a parallel service mirrors
        them to its other ranks in the worker's order). It holds a threadpool thread until `owner`'s
        turn comes, so a key has at most `MAX_WAITING` of these at once: 45 held every thread, and
        every other key's requests with them, while the key's own queue ran (93 s)."""
        with self.lock:
            if self.waiting[owner] >= MAX_WAITING:
                raise BadRequest(f"this key has {MAX_WAITING} calls waiting on the worker; try again", 429)
            self.waiting[owner] += 1
        try:
            return wait_for(self.worker, fn, owner)
        finally:
            with self.lock:
                self.waiting[owner] -= 1

    async def retrieve(self, body: dict) -> tuple[bytes, str]:
        """The outcome, once: a retrieved result is released (results are as large as their calls;
        one not retrieved within an hour is dropped)."""
        rid = body.get("request_id", "")
        with self.lock:
            fut = self.futures.get(rid) if isinstance(rid, str) else None
            dropped = fut is None and rid in self.dropped
        if dropped:
            raise BadRequest(
                f"request_id {rid!r} was dropped unread: this key's unread results passed "
                f"{self.max_unread_bytes >> 20} MiB (--max-unread-mib)",
                410,
            )
        if fut is None:
            raise BadRequest(f"unknown request_id {rid!r}", 404)
        try:
            await asyncio.wait_for(fut.done.wait(), self.poll_seconds)
        except TimeoutError:
            again = {"type": "try_again", "request_id": rid, "queue_state": "active"}
            return json.dumps(again).encode(), "application/json"
        with self.lock:
            self._forget(rid)
        return fut.body, PROTO if fut.proto else "application/json"
