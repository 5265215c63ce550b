"""`serve --record`: each served request written to the trace store before its response goes out.

A problem with the store never blocks serving: a write that fails (a lock held too long, a full
disk, a database gone) is counted, its error kept for `/health`, and printed once per kind; the
response is sent all the same. A write that succeeds has committed before the response is sent,
so an acknowledged response's record survives a kill -9 of the server.
"""

from __future__ import annotations

import asyncio
import sys

from .store import TraceStore
from .types import Call, OverBudget


class Recorder:
    def __init__(self, where: str, max_calls: int, max_mib: float):
        """`max_calls`, `max_mib`: what each key's recorded traffic may hold (`TraceStore.check_budget`;
        `ServeConfig.max_trace_rows` and `max_trace_mib` hold their defaults)."""
        self.store, self.max_calls, self.max_bytes = TraceStore(where), max_calls, int(max_mib * 2**20)
        self.recorded = 0
        """Calls (choices) committed."""
        self.failed = 0
        """Calls that could not be written (served all the same)."""
        self.last_error = ""
        self._reported: set[str] = set()

    async def over_budget(self, owner: str) -> str | None:
        """Why `owner`'s requests are refused, once its recorded traffic holds its budget; None
        otherwise, and when the store cannot answer (the record then fails and is counted, as any)."""
        try:
            await asyncio.to_thread(self.store.check_budget, owner, self.max_calls, self.max_bytes)
        except OverBudget as e:
            return str(e)
        except Exception:  # noqa: BLE001, S110 - a failing store never blocks serving
            pass
        return None

    async def record(self, calls: list[Call]) -> bool:
        """Commit one request's calls off the event loop; False (counted) when the store failed."""
        try:
            await asyncio.to_thread(self.store.record, calls)
        except Exception as e:  # noqa: BLE001 - whatever the store raised, serving goes on
            self.failed += len(calls)
            self.last_error = f"{type(e).__name__}: {e}"
            if type(e).__name__ not in self._reported:
                self._reported.add(type(e).__name__)
                print(
                    f"trillora serve: recording to {self.store.shown} failed ({self.last_error}); "
                    f"serving goes on, failures are counted in /health",
                    file=sys.stderr,
                    flush=True,
                )
            return False
        self.recorded += len(calls)
        return True

    def health(self) -> dict:
        return {
            "store": self.store.shown,
            "recorded": self.recorded,
            "failed": self.failed,
            "last_error": self.last_error,
        }

    def close(self) -> None:
        self.store.close()
