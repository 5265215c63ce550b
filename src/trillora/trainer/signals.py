"""Stopping cleanly: SIGTERM or Ctrl-C asks the loop to stop after the step in progress, save a
checkpoint and exit, so a step is never cut in half by our own shutdown."""

from __future__ import annotations

import contextlib
import signal
import threading

from rich.console import Console

from .world import World


class StopSignal:
    """SIGTERM / SIGINT set a flag the loop reads between steps; under torchrun the ranks agree
    (any rank stopping stops all), so they all save the same checkpoint."""

    def __init__(self, world: World, console: Console):
        self.requested = False
        self.world, self.console = world, console

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

        def handler(signum, frame):
            if self.requested:  # a second signal: stop now
                signal.signal(signum, previous[signum])
                signal.raise_signal(signum)
            self.requested = True
            self.console.print(
                "[yellow]stopping after this step; a checkpoint will be saved (signal again to stop now)[/]"
            )

        for s in previous:
            signal.signal(s, handler)
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def now(self) -> bool:
        """Whether any rank was asked to stop (a collective under torchrun: every rank calls it)."""
        return self.world.any(self.requested)
