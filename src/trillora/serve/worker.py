"""The Tinker service's one compute thread: every request that touches the model runs here.

Order: each training client's requests run in its `seq_id` order (the SDK sends the chunks of
one call in parallel, the first one last); everything else in arrival order, taken in turns by
key (`Job.owner`): the next request is the oldest of the key served longest ago, so one key's
queue holds another key's request behind at most one pass of its own at a time. Fusing: requests
of one kind that wait together (forward_backward chunks and calls of several clients; samples
of several samplers) are handed to that kind's fuser as one batch, so they share one pass
through the base. A request is never moved ahead of an earlier one of its own client.
Clients in lock-step (each waiting for its last result) would otherwise never have requests
waiting together: when another client sent the same kind of request within the last second,
the worker holds a lone fusable request up to `gather_seconds` for company. A client alone is
never held.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Job:
    """One queued request. `fuse`: the kind of request it can share a pass with (None: alone);
    `payload`: what that kind's fuser needs; `run`: how it runs alone. `settle` receives its
    outcome, a result or the exception it raised."""

    run: Callable[[], Any]
    settle: Callable[[Any], None]
    model_id: str | None = None
    fuse: str | None = None
    payload: Any = None
    arrived: float = field(default_factory=time.monotonic)
    owner: str = ""
    """The digest of the key that sent it (`http.owner_of`): keys take turns."""


Fuser = Callable[[list[Any]], list[Any]]  # payloads -> one outcome (result or exception) each


class Replayed(ValueError):
    """A client's `seq_id` that was already submitted: run once, never twice."""


class Worker:
    def __init__(
        self,
        fusers: dict[str, Fuser] | None = None,
        max_fused: int = 16,
        gather_seconds: float = 0.01,
        stall_seconds: float = 10.0,
    ):
        self.fusers, self.max_fused, self.stall_seconds = fusers or {}, max_fused, stall_seconds
        self.gather_seconds = gather_seconds
        self.recent: collections.deque[Job] = collections.deque()  # fusable jobs of the last second
        self.runnable: collections.deque[Job] = collections.deque()
        self.waiting: dict[str, list] = {}  # model_id -> heap of (seq_id, arrival, job)
        self.next_seq: dict[str, int] = {}
        self.since: dict[str, float] = {}
        self.seen: dict[str, tuple[int, set[int]]] = {}
        """model_id -> (every seq_id below this was submitted, those submitted above it)."""
        self.ready = threading.Condition()
        self.order = itertools.count()
        self.served: dict[str, int] = {}  # owner -> when it last had a job taken (in `order`'s count)
        self.fused_batches = 0  # passes that served more than one request
        self.thread = threading.Thread(target=self._run, daemon=True, name="tinker-worker")
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def submit(self, job: Job, seq_id: int | None = None) -> None:
        if seq_id is not None and (not isinstance(seq_id, int) or isinstance(seq_id, bool)):
            raise TypeError(f"seq_id={seq_id!r} is not an integer")  # in the heap it would stop the worker
        with self.ready:
            if job.model_id is not None and seq_id is not None:
                self._mark(job.model_id, seq_id)
            if job.fuse is not None:
                self.recent.append(job)
                while self.recent and job.arrived - self.recent[0].arrived > 1.0:
                    self.recent.popleft()
            if job.model_id is None or seq_id is None:
                self.runnable.append(job)
            else:
                heapq.heappush(self.waiting.setdefault(job.model_id, []), (seq_id, next(self.order), job))
                self.since.setdefault(job.model_id, time.monotonic())
                self._release(job.model_id)
            self.ready.notify()

    def _mark(self, model_id: str, seq_id: int) -> None:
        low, above = self.seen.get(model_id, (1, set()))
        if seq_id < 1:
            raise Replayed(f"seq_id {seq_id}: a training client's requests are numbered from 1 (as the SDK does)")
        if seq_id < low or seq_id in above:
            raise Replayed(f"seq_id {seq_id} of {model_id} was already sent; each request runs once")
        above.add(seq_id)
        while low in above:
            above.remove(low)
            low += 1
        self.seen[model_id] = (low, above)

    def _release(self, model_id: str, force: bool = False) -> None:
        heap = self.waiting.get(model_id, [])
        expected = self.next_seq.get(model_id, 1)
        while heap and (heap[0][0] <= expected or force):
            seq, _, job = heapq.heappop(heap)
            expected = max(expected, seq) + 1
            force = False
            self.runnable.append(job)
            self.since[model_id] = time.monotonic()
        self.next_seq[model_id] = expected

    def _take(self) -> list[Job]:
        """The next job and, if it fuses, the later runnable jobs of its kind that no earlier job of
        their own client precedes."""
        with self.ready:
            while not self.runnable:
                if not self.ready.wait(timeout=1.0):  # a seq_id that never came must not stall the rest
                    for model_id, heap in self.waiting.items():
                        if heap and time.monotonic() - self.since[model_id] > self.stall_seconds:
                            self._release(model_id, force=True)
            first = self._next_in_turn()
            if first.fuse is None or first.fuse not in self.fusers or self.max_fused < 2:
                return [first]
            deadline = time.monotonic() + self.gather_seconds
            while (
                not any(j.fuse == first.fuse and j.owner == first.owner for j in self.runnable)
                and self._company_expected(first)
                and time.monotonic() < deadline
            ):
                self.ready.wait(max(0.0, deadline - time.monotonic()))
            batch, kept, blocked = [first], collections.deque(), set()
            for job in self.runnable:  # of the same key: another key's calls wait for their own turn
                source = job.model_id if job.model_id is not None else ("key", job.owner)  # a client, or a key's
                if (
                    job.fuse == first.fuse
                    and job.owner == first.owner
                    and source not in blocked
                    and len(batch) < self.max_fused
                ):
                    batch.append(job)
                else:
                    kept.append(job)
                    blocked.add(source)
            self.runnable = kept
            return batch

    def _next_in_turn(self) -> Job:
        """The oldest runnable job of the key served longest ago (or an earlier one of the same
        client, which must run first)."""
        oldest: dict[str, int] = {}  # owner -> the position of its oldest runnable job
        for i, j in enumerate(self.runnable):
            oldest.setdefault(j.owner, i)
        if len(oldest) == 1:
            first = self.runnable.popleft()
        else:
            owner = min(oldest, key=lambda o: (self.served.get(o, -1), oldest[o]))
            first = self.runnable[oldest[owner]]
            if first.model_id is not None:
                first = next(j for j in self.runnable if j.model_id == first.model_id)
            self.runnable.remove(first)
        self.served[first.owner] = next(self.order)
        return first

    def _company_expected(self, first: Job) -> bool:
        """Another source of the same key sent this kind of request within the last second (for
        samples, which belong to no client, any other sample)."""
        now = time.monotonic()
        return any(
            j is not first
            and j.fuse == first.fuse
            and j.owner == first.owner
            and now - j.arrived < 1.0
            and (first.model_id is None or j.model_id != first.model_id)
            for j in self.recent
        )

    def _run(self) -> None:
        while True:
            batch = self._take()
            if len(batch) == 1:
                outcomes = [_outcome(batch[0].run)]
            else:
                self.fused_batches += 1
                outcomes = _outcome(lambda: self.fusers[batch[0].fuse]([j.payload for j in batch]))  # noqa: B023 - called here
                if isinstance(outcomes, Exception):
                    outcomes = [outcomes] * len(batch)
            for job, out in zip(batch, outcomes, strict=True):
                job.settle(out)


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # settled as the request's error; the worker goes on
        return e


def wait_for(worker: Worker, run: Callable[[], Any], owner: str = "") -> Any:
    """Queue `run` and block this (non-event-loop) thread until its outcome; raises what it raised."""
    box, done = [], threading.Event()
    worker.submit(Job(run, lambda out: (box.append(out), done.set()), owner=owner))
    done.wait()
    return raised(box[0])


async def outcome_of(
    worker: Worker, run: Callable[[], Any], fuse: str | None = None, payload: Any = None, owner: str = ""
) -> Any:
    """Queue `run` (or, when it fuses, its share of a pass) and wait for its outcome on the event
    loop, holding no thread while it waits; raises what it raised."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(out: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the server has stopped: nobody waits any more
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(out))

    worker.submit(Job(run, settle, None, fuse, payload, owner=owner))
    return raised(await done)


def raised(outcome: Any) -> Any:
    """A job's outcome, or what it raised raised here."""
    if isinstance(outcome, Exception):
        raise outcome
    return outcome
