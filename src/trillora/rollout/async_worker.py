"""Asynchronous rollouts: the engine samples step s+1 while the trainer learns from step s.

A thread asks the engine for each step's completions in order, as soon as the engine's adapter
revision (updates synced into it) is at least `step - staleness`: with staleness K a batch is
sampled by a policy at most K updates old. An engine whose sync rewrites weights in place (the
local engine, merged syncs) samples under the same lock its syncs take, so it never samples from
half-written weights; a server engine with adapter revisions keeps the last K+1 loaded and samples
from a pinned revision outside the lock, so a sync can land while a batch is being sampled. The
trainer syncs after every update and the thread wakes. What the thread produced waits in a queue of at most K batches.
Rewards are scored
by the trainer (its main thread, where reward time limits work), and each batch reports the
revision it was sampled with; the mismatch correction already uses the sampler's own logprobs,
i.e. the sampling revision's.

With staleness 0 the thread waits for every update: the synchronous loop, in a thread.

Multi-turn envs sample ahead the same way: the request is then a job that runs a step's episodes
on the engine it is given (env calls on this thread, where SIGALRM time limits do not reach:
envs that may hang need their own limits, like the Python tool's sandbox).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .types import RolloutEngine, SamplingParams


@dataclass
class Sampled:
    step: int
    request: Any  # what the caller asked with (its problems)
    groups: list  # [P][n] Completions, or what an episode job returned
    revision: int  # updates the engine's weights included when it sampled this batch


class RolloutWorker:
    def __init__(
        self,
        engine: RolloutEngine,
        request: Callable[[int], tuple[Any, list[list[int]], int, SamplingParams]],
        first_step: int,
        last_step: int,
        staleness: int,
    ):
        """`request(step)` -> (anything to hand back, prompts, n, sampling params) for that step; or
        (anything, job, None, None) where `job(engine)` samples the step itself (episodes)."""
        if staleness < 0:
            raise ValueError(f"staleness={staleness}; must be >= 0")
        self.engine, self.request, self.staleness = engine, request, staleness
        self.lock = threading.Lock()  # generate and sync never overlap
        self.changed = threading.Condition()
        self.revision = first_step
        self.stopped = False
        self.out: queue.Queue = queue.Queue(maxsize=max(staleness, 1))
        self.thread = threading.Thread(target=self._run, args=(first_step, last_step), name="rollout", daemon=True)
        self.thread.start()

    def _run(self, first: int, last: int) -> None:
        try:
            for step in range(first, last):
                with self.changed:
                    self.changed.wait_for(lambda s=step: self.stopped or self.revision >= s - self.staleness)
                if self.stopped:
                    return
                handle, prompts, n, params = self.request(step)
                with self.lock:
                    revision = self.revision
                    pinned = self.engine.pinned()
                    if pinned is None:  # weights changed in place by a sync: sample under the lock
                        groups = prompts(self.engine) if callable(prompts) else self.engine.generate(prompts, n, params)
                if pinned is not None:  # a server keeping this revision loaded: a sync may land meanwhile
                    groups = prompts(_Pinned(pinned)) if callable(prompts) else pinned(prompts, n, params)
                self._put(Sampled(step, handle, groups, revision))
        except BaseException as e:  # handed to the trainer, which raises it
            self._put(e)

    def _put(self, item) -> None:
        while not self.stopped:
            try:
                self.out.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def take(self, step: int) -> Sampled:
        item = self.out.get()
        if isinstance(item, BaseException):
            raise item
        if item.step != step:
            raise RuntimeError(f"rollout worker produced step {item.step}, the trainer is at step {step}")
        return item

    def synced(self, sync: Callable[[], dict]) -> dict:
        """Run the trainer's engine sync under the lock; the engine's revision goes up by one before
        the lock is let go, so a batch sampled right after the sync reports the revision it used
        (counted after the release, such a batch would be reported one update staler than it was)."""
        with self.lock:
            metrics = sync()
            with self.changed:  # the thread never holds `changed` while it waits for `lock`
                self.revision += 1
                self.changed.notify_all()
        return metrics

    def close(self) -> None:
        with self.changed:
            self.stopped = True
            self.changed.notify_all()
        self.thread.join(timeout=60)


class _Pinned:
    """One pinned revision of a server engine, as an engine for an episode job."""

    def __init__(self, generate: Callable):
        self.generate = generate
