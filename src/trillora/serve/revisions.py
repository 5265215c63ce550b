"""A learning server's revisions: each published revision k is served as `name@k`, and `name`
follows the newest one (or the one a rollback chose).

A request takes its revision's id when it arrives (`Registry.served`), so a request in flight
finishes on the revision it started with while new ones get the new revision. The last `keep`
revisions stay servable; `POST /v1/revisions/rollback` points `name` back at one of them.
`GET /v1/revisions` lists them with their training rows, and the learner's progress.
"""

from __future__ import annotations

import sys
import threading
import time

import torch
from fastapi import APIRouter, Request

from ..policy.adapters import Revision
from .calls import BadRequest
from .http import check_operator, json_object, owner_of
from .worker import outcome_of, wait_for


class Revisions:
    def __init__(self, service, name: str, keep: int):
        self.service, self.name, self.keep = service, name, keep
        self.current: int | None = None
        """The revision `name` serves (None: the model itself, before any was published)."""
        self.published: dict[int, float] = {}  # revision -> when
        self.learner, self.worker, self.stopped, self.thread = None, None, threading.Event(), None
        self.rounds = self.failures = self.skipped = 0
        self.last_error = ""
        self.lock = threading.Lock()
        r = self.router = APIRouter()
        r.add_api_route("/v1/revisions", self.listing, methods=["GET"])
        r.add_api_route("/v1/revisions/rollback", self.rollback, methods=["POST"])

    def publish(self, k: int, tensors: dict[str, torch.Tensor], config) -> None:
        """Serve revision k as `name@k`, point `name` at it, and let revisions older than `keep` go."""
        with self.lock:
            self.service.registry.publish(self.name, k, Revision(config, tensors), self.keep)
            self.published[k] = time.time()
            self.current = k
            for old in [r for r in self.published if r <= k - self.keep]:
                del self.published[old]

    async def listing(self, request: Request) -> dict:
        """The kept revisions; their training rows, the round counts and the last error for the operator's
        key only (they describe every key's trained traffic: trace counts, rewards, dropped traces)."""
        mine = self.operator(request.scope)
        history = {row["revision"]: row for row in (self.learner.history if self.learner is not None and mine else [])}
        counts = {"rounds": self.rounds, "failures": self.failures, "skipped": self.skipped} if mine else {}
        return {
            "model": self.name,
            "current": self.current,
            **counts,
            "last_error": self.last_error if mine else "",
            "revisions": [
                {"id": f"{self.name}@{k}", "revision": k, "published": t, "training": history.get(k, {})}
                for k, t in sorted(self.published.items())
            ],
        }

    def operator(self, scope: dict) -> bool:
        """The request carries the operator's key (or the server has none): it may see training rows."""
        operator = self.service.cfg.operator()
        return operator is None or owner_of(scope) == operator

    def models(self, mine: bool = True) -> dict[str, dict]:
        """What `/v1/models` adds to each kept revision's entry (and to `NAME`'s: the one it serves);
        the gate scores for the operator's key only (`mine`)."""
        history = {row["revision"]: row for row in (self.learner.history if self.learner is not None and mine else [])}
        out = {}
        for k in sorted(self.published):
            row = history.get(k, {})
            out[f"{self.name}@{k}"] = {
                "revision": k,
                "current": k == self.current,
                **({"gate_score": row["gate_score"]} if "gate_score" in row else {}),
            }
        if self.current is not None:
            out[self.name] = {"serves": f"{self.name}@{self.current}"}
        return out

    async def rollback(self, request: Request) -> dict:
        """`{"revision": k}` (default: the one before the current) becomes what `name` serves."""
        check_operator(request.scope, self.service.cfg.operator(), "a rollback")
        body = json_object(await request.body())
        with self.lock:
            kept = sorted(self.published)
            default = max((k for k in kept if self.current is not None and k < self.current), default=None)
            k = body.get("revision", default)
            if isinstance(k, bool) or not isinstance(k, int) or k not in self.published:
                raise BadRequest(
                    f"revision {k!r} is not kept; kept: {kept} (learn.keep={self.keep})", 404 if kept else 400
                )
        if self.learner is not None:  # the learner goes on from the revision rolled back to
            await outcome_of(self.worker, lambda: self.service.restore_revision(k))
        with self.lock:
            self.service.registry.aliases[self.name] = f"{self.name}@{k}"
            self.current = k
        return {"model": self.name, "current": k}

    def attach(self, learner, worker, poll_seconds: float = 1.0) -> threading.Thread:
        """Run `learner` rounds whenever one is due, from a thread of their own: the traces are read
        there, the update runs on `worker` between served requests."""
        self.learner, self.worker, self.stopped = learner, worker, threading.Event()

        def loop() -> None:
            while not self.stopped.wait(poll_seconds):
                try:
                    if not learner.due():
                        continue
                    exp = learner.prepare()  # the store's work here; only the model's on the compute thread
                    if exp is None:
                        continue
                    out = wait_for(worker, lambda: self.service.learn(exp))  # noqa: B023 - waited for here
                    if out is not None and (out.get("skipped") or out.get("gated")):
                        self.skipped += 1
                        self.last_error = (
                            "a round's update was not finite" if out.get("skipped") else "a revision failed its gate"
                        )
                    elif out is not None:
                        self.rounds += 1
                except Exception as e:  # noqa: BLE001 - a failed round is counted and shown; serving goes on
                    self.failures += 1
                    self.last_error = f"{type(e).__name__}: {e}"
                    print(f"trillora serve: a learning round failed ({self.last_error})", file=sys.stderr, flush=True)

        self.thread = threading.Thread(target=loop, name="learner", daemon=True)
        self.thread.start()
        return self.thread

    def stop(self) -> None:
        """No new round; the one running (if any) finishes first."""
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()
