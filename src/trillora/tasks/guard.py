"""Rewards are user code: each call gets a time limit, and a failure either stops the run with
the traceback or scores 0 and is counted (`task.on_reward_error`).

The limit is SIGALRM's interval timer in the main thread (what the trainer runs in): it costs
a system call per reward, interrupts a Python loop or a sleep, and needs no thread or process
per call. Code that can do worse than hang (run generated programs, touch the network) belongs
in `trillora.sandbox.jail`, which runs it in a separate, limited process.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from dataclasses import dataclass
from typing import Literal, get_args

from ..errors import TrilloraError
from .base import Problem, Task

OnRewardError = Literal["fail", "zero"]
ON_ERROR: tuple[str, ...] = get_args(OnRewardError)


class RewardError(TrilloraError, RuntimeError):
    """A reward function that raised, hung or returned a non-number; the message names the task
    and the prompt, the cause carries the traceback."""

    show_cause = True  # the CLI prints the user's traceback (file and line) before the message


class RewardTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise RewardTimeout in the body after `seconds` (0: no limit; off the main thread: no limit).

    Limits nest (a tool's inside its env's step): the inner one is cut to what the outer has left,
    and the outer is re-armed with the rest when the inner ends."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return
    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    limit = min(seconds, outer_left) if outer_left > 0 else seconds

    def on_alarm(signum, frame):
        raise RewardTimeout(f"no result after {limit:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left > 0:  # the outer limit keeps running: at least a moment, so it still fires
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - start), 1e-3))


@dataclass
class GuardedReward:
    task: Task
    timeout: float = 30.0
    on_error: str = "fail"
    failures: int = 0  # calls scored 0 for an error, a timeout or a non-finite value (on_error="zero")

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_reward_error={self.on_error!r}; allowed: {', '.join(ON_ERROR)}")

    def __call__(self, problem: Problem, completion: str) -> float:
        try:
            with time_limit(0 if getattr(self.task, "reward_is_ours", False) else self.timeout):
                value = self.task.reward(problem, completion)
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"returned {value}, not a finite number")
        except Exception as e:  # the user's code: anything can come out of it
            if self.on_error == "fail":
                what = "timed out" if isinstance(e, RewardTimeout) else "failed"
                raise RewardError(
                    f"reward of task {self.task.name!r} {what} on prompt {problem.prompt!r}: "
                    f"{type(e).__name__}: {e} (task.on_reward_error='zero' scores such calls 0)"
                ) from e
            self.failures += 1
            return 0.0
        return value
