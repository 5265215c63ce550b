"""Stopping cleanly: SIGTERM or Ctrl-C asks the loop to stop after the step in progress, save a
checkpoint and exit, so a step is never cut in half by our own shutdown. A run stopped so exits
with 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM), as a shell reports a process a
signal ended: a script tells it from a finished run (exit 0). A second signal stops at once."""

from __future__ import annotations

import contextlib
import signal
import threading

from rich.console import Console

from ..policy.world import World


class StopSignal:
    """SIGTERM / SIGINT set a flag the loop reads between steps; under torchrun the ranks agree
    (any rank stopping stops all), so they all save the same checkpoint."""

    def __init__(self, world: World, console: Console):
        self.requested = False
        self.signum: int | None = None
        """The signal this process was sent (a rank that was not sent one stops with its peers)."""
        self.world, self.console = world, console

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

        def handler(signum, frame):
            if self.requested:  # a second signal: stop now, without the checkpoint
                if signum == signal.SIGINT:
                    raise KeyboardInterrupt  # the CLI answers it with exit 130
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)
            self.requested, self.signum = True, signum
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

    @property
    def exit_code(self) -> int:
        """What the process exits with after stopping: 128 + the signal (SIGTERM's for a rank that was not sent one)."""
        return 128 + (self.signum or signal.SIGTERM)

    def now(self) -> bool:
        """Whether any rank was asked to stop (a collective under torchrun: every rank calls it)."""
        return self.world.any(self.requested)
