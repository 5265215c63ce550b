"""The trace store: every served call and every piece of feedback, in SQLite or PostgreSQL.

One schema and one set of queries for both. SQLite is the embedded default: WAL with
`synchronous=FULL`, so a call whose commit returned is on disk before its response is sent, and
survives a kill -9 of the server (and a power cut). PostgreSQL, named by a `postgresql://` URL, is
the same store shared by several servers on several machines (each commit is durable when it
returns, PostgreSQL's default).

A call row is one choice of one served request: the exact prompt and completion token ids and the
completion's per-token logprobs as the engine sampled them, the revision that served it, the
sampling settings, the parsed tool calls. Token lists are stored as JSON text: portable between
the two databases and readable with any SQL client. `owner` is a digest of the API key whose
traffic it was: feedback and reads are answered only for the owner's own traces.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import TrilloraError


class TraceError(TrilloraError):
    """A store that cannot be opened, or a request it cannot take (what is wrong is named)."""


MAX_REWARD = 1e6
"""Rewards are bounded: one huge reward would make every advantage of its round overflow."""
MAX_FEEDBACK = 32
"""Feedback rows one trace may hold (they are averaged; more only fills the disk)."""
HELD_OUT = -2
"""The `trained` revision of a trace kept out of training for the learner's gate (`learn.holdout`)."""


class TooMuchFeedback(TraceError):
    """A trace that already holds MAX_FEEDBACK rewards."""


class UnknownTrace(TraceError):
    """A trace or response this key's traffic does not hold (another key's is not told apart)."""


@dataclass
class Call:
    """One choice of one served request."""

    response_id: str
    choice: int
    trace_id: str
    owner: str
    model: str
    revision: str
    kind: str  # "chat" or "completion"
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    params: dict = field(default_factory=dict)
    finish_reason: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    user_id: str = ""
    tag: str = ""
    """What kind of task the call served (`metadata.task`): learning keeps a baseline per tag."""
    created: float = field(default_factory=time.time)

    @property
    def revision_number(self) -> int:
        """k of a learner's revision `name@k`; 0 for the base or a loaded adapter."""
        head, _, k = self.revision.rpartition("@")
        return int(k) if head and k.isdigit() else 0


@dataclass
class Feedback:
    trace_id: str
    owner: str
    reward: float
    response_id: str = ""
    label: str = ""
    comment: str = ""
    created: float = field(default_factory=time.time)


_LISTS = ("prompt_ids", "completion_ids", "logprobs", "params", "tool_calls")
_CALL_COLUMNS = tuple(f.name for f in fields(Call))
_FEEDBACK_COLUMNS = tuple(f.name for f in fields(Feedback))
_TRACE_FIELDS = ("owner", "trace_id", "user_id", "calls", "first", "last", "rewards", "mean_reward")
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS calls (response_id TEXT NOT NULL, choice INTEGER NOT NULL, trace_id TEXT NOT NULL, "
    "owner TEXT NOT NULL, model TEXT NOT NULL, revision TEXT NOT NULL, kind TEXT NOT NULL, prompt_ids TEXT NOT NULL, "
    "completion_ids TEXT NOT NULL, logprobs TEXT NOT NULL, params TEXT NOT NULL, tool_calls TEXT NOT NULL, "
    "finish_reason TEXT NOT NULL, user_id TEXT NOT NULL, tag TEXT NOT NULL, created DOUBLE PRECISION NOT NULL, "
    "PRIMARY KEY (response_id, choice))",
    "CREATE INDEX IF NOT EXISTS calls_trace ON calls (owner, trace_id, created)",
    "CREATE TABLE IF NOT EXISTS feedback (trace_id TEXT NOT NULL, owner TEXT NOT NULL, reward DOUBLE PRECISION "
    "NOT NULL, response_id TEXT NOT NULL, label TEXT NOT NULL, comment TEXT NOT NULL, "
    "created DOUBLE PRECISION NOT NULL)",
    "CREATE INDEX IF NOT EXISTS feedback_trace ON feedback (owner, trace_id)",
    "CREATE TABLE IF NOT EXISTS trained (owner TEXT NOT NULL, trace_id TEXT NOT NULL, revision INTEGER NOT NULL, "
    "created DOUBLE PRECISION NOT NULL, PRIMARY KEY (owner, trace_id))",
    "CREATE INDEX IF NOT EXISTS trained_revision ON trained (revision, created)",
)


class TraceStore:
    def __init__(self, where: str, busy_seconds: float = 1.0):
        """`where`: a SQLite file path, or a `postgresql://` URL. `busy_seconds`: how long a write
        waits for a lock held elsewhere before it fails (a failed write is the caller's to count)."""
        self.where, self.lock, self.busy_seconds = where, threading.Lock(), busy_seconds
        self.postgres = where.startswith(("postgresql://", "postgres://"))
        try:
            self.db = self._connect()
            for statement in _SCHEMA:
                self.db.execute(statement)
            self.db.commit()
        except Exception as e:  # noqa: BLE001 - sqlite3, psycopg and OS errors alike name the store
            raise TraceError(f"trace store {self.shown}: cannot open: {type(e).__name__}: {e}") from None

    def _connect(self):
        if self.postgres:
            import psycopg

            return psycopg.connect(
                self.where, connect_timeout=10, options=f"-c lock_timeout={int(self.busy_seconds * 1000)}"
            )
        Path(self.where).parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.where, timeout=self.busy_seconds, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        return db

    def _cursor(self):
        """A cursor on a live connection: a PostgreSQL connection lost with its server is made again."""
        if self.postgres and (self.db.closed or self.db.broken):
            self.db = self._connect()
        return self.db.cursor()

    @property
    def shown(self) -> str:
        """The store's name without a password."""
        password = urlsplit(self.where).password if self.postgres else None
        return self.where.replace(f":{password}@", ":***@") if password else self.where

    def _sql(self, text: str) -> str:
        return text.replace("?", "%s") if self.postgres else text

    def _write(self, text: str, rows: list[tuple]) -> None:
        self._run(text, rows, write=True)

    def _read(self, text: str, args: tuple = ()) -> list[tuple]:
        return self._run(text, args, write=False)

    def _run(self, text: str, args, write: bool) -> list[tuple]:
        """One statement in its own transaction: a write over many rows, or a read (its commit ends
        PostgreSQL's read transaction, so later reads see new rows)."""
        with self.lock:
            try:
                cur = self._cursor()
                (cur.executemany if write else cur.execute)(self._sql(text), args)
                rows = [] if write else cur.fetchall()
                self.db.commit()
                return rows
            except Exception:
                if not (self.postgres and self.db.closed):
                    self.db.rollback()
                raise

    # --- writes -------------------------------------------------------------------------------
    def record(self, calls: list[Call]) -> None:
        """One request's choices, in one transaction: durable when this returns."""
        rows = []
        for c in calls:
            d = asdict(c)
            rows.append(tuple(json.dumps(d[k]) if k in _LISTS else d[k] for k in _CALL_COLUMNS))
        self._write(
            f"INSERT INTO calls ({', '.join(_CALL_COLUMNS)}) VALUES ({', '.join('?' * len(_CALL_COLUMNS))})", rows
        )

    def add_feedback(self, fb: Feedback) -> None:
        """Feedback on one of the owner's traces; TraceError naming what is wrong otherwise."""
        r = fb.reward
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r) or abs(r) > MAX_REWARD:
            shown = repr(r) if len(repr(r)) < 40 else repr(r)[:40] + "..."
            raise TraceError(f"reward must be a finite number in [-{MAX_REWARD:g}, {MAX_REWARD:g}], not {shown}")
        where, args = (
            ("response_id = ?", (fb.owner, fb.response_id))
            if fb.response_id
            else ("trace_id = ?", (fb.owner, fb.trace_id))
        )
        found = self._read(f"SELECT trace_id FROM calls WHERE owner = ? AND {where} LIMIT 1", args)
        if not found:
            what = f"response {fb.response_id!r}" if fb.response_id else f"trace {fb.trace_id!r}"
            raise UnknownTrace(f"no {what} in this key's recorded traffic")
        fb.trace_id = found[0][0]
        same = (fb.owner, fb.trace_id)
        [(held,)] = self._read("SELECT COUNT(*) FROM feedback WHERE owner = ? AND trace_id = ?", same)
        if held >= MAX_FEEDBACK:
            raise TooMuchFeedback(f"trace {fb.trace_id!r} already holds {MAX_FEEDBACK} rewards (they are averaged)")
        d = asdict(fb)
        self._write(
            f"INSERT INTO feedback ({', '.join(_FEEDBACK_COLUMNS)}) VALUES ({', '.join('?' * len(_FEEDBACK_COLUMNS))})",
            [tuple(d[k] for k in _FEEDBACK_COLUMNS)],
        )

    def delete(self, older_than: float | None = None, user_id: str | None = None, trace_id: str | None = None) -> int:
        """Traces whose last call is older than `older_than` seconds, or whose calls came from
        `user_id`, or the one trace: their calls and feedback. Returns how many traces went."""
        if older_than is None and user_id is None and trace_id is None:
            raise TraceError("delete needs an age, a user id or a trace id (nothing is deleted without one)")
        keys = sorted(
            {
                (t["owner"], t["trace_id"])
                for t in self.traces(older_than=older_than, user_id=user_id, trace_id=trace_id)
            }
        )
        for table in ("calls", "feedback", "trained"):
            self._write(f"DELETE FROM {table} WHERE owner = ? AND trace_id = ?", keys)
        return len(keys)

    # --- reads --------------------------------------------------------------------------------
    def calls(self, trace_id: str, owner: str | None = None) -> list[Call]:
        """A trace's calls in the order they were served (one owner's only, when given)."""
        rows = self._select(_CALL_COLUMNS, "calls", trace_id, owner, "created, response_id, choice")
        return [
            Call(**{k: json.loads(v) if k in _LISTS else v for k, v in zip(_CALL_COLUMNS, r, strict=True)})
            for r in rows
        ]

    def feedback(self, trace_id: str, owner: str | None = None) -> list[Feedback]:
        rows = self._select(_FEEDBACK_COLUMNS, "feedback", trace_id, owner, "created")
        return [Feedback(**dict(zip(_FEEDBACK_COLUMNS, r, strict=True))) for r in rows]

    def _select(self, columns: tuple[str, ...], table: str, trace_id: str, owner: str | None, order: str) -> list:
        mine, args = ("", (trace_id,)) if owner is None else (" AND owner = ?", (trace_id, owner))
        return self._read(f"SELECT {', '.join(columns)} FROM {table} WHERE trace_id = ?{mine} ORDER BY {order}", args)

    def traces(
        self,
        older_than: float | None = None,
        user_id: str | None = None,
        trace_id: str | None = None,
        untrained: bool = False,
    ) -> list[dict]:
        """One summary per trace (a key's trace id: two keys naming the same id hold two traces):
        owner, id, user, calls, first and last call time, rewards given and their mean; with
        `untrained`, only those no revision has trained on."""
        same = "f.owner = c.owner AND f.trace_id = c.trace_id"
        query = (
            "SELECT c.owner, c.trace_id, MIN(c.user_id), COUNT(*), MIN(c.created), MAX(c.created), "
            f"(SELECT COUNT(*) FROM feedback f WHERE {same}), (SELECT AVG(f.reward) FROM feedback f WHERE {same}) "
            "FROM calls c"
        )
        where, args = [], []
        if user_id is not None:
            where, args = where + ["c.user_id = ?"], args + [user_id]
        if trace_id is not None:
            where, args = where + ["c.trace_id = ?"], args + [trace_id]
        if untrained:
            where.append("NOT EXISTS (SELECT 1 FROM trained t WHERE t.owner = c.owner AND t.trace_id = c.trace_id)")
        query += (" WHERE " + " AND ".join(where) if where else "") + " GROUP BY c.owner, c.trace_id"
        if older_than is not None:
            query, args = query + " HAVING MAX(c.created) < ?", args + [time.time() - older_than]
        rows = self._read(query + " ORDER BY MIN(c.created)", tuple(args))
        return [dict(zip(_TRACE_FIELDS, r, strict=True)) for r in rows]

    def mark_trained(self, keys: list[tuple[str, str]], revision: int) -> None:
        """The learner's record that these traces ((owner, trace id)) went into `revision` (-1: left
        out for good, `HELD_OUT`: kept for a gate); none is trained on twice."""
        self._write(
            "INSERT INTO trained (owner, trace_id, revision, created) VALUES (?, ?, ?, ?)",
            [(o, t, revision, time.time()) for o, t in keys],
        )

    def held_out(self, limit: int) -> list[tuple[str, str]]:
        """The oldest `limit` traces marked `HELD_OUT` (a gate replays them), as (owner, trace id)."""
        rows = self._read(
            "SELECT owner, trace_id FROM trained WHERE revision = ? ORDER BY created, owner, trace_id LIMIT ?",
            (HELD_OUT, limit),
        )
        return [(o, t) for o, t in rows]

    def untrained(self, rewarded_only: bool) -> list[dict]:
        """Summaries (as `traces`) of the traces no revision has trained on, oldest first; only
        those with feedback when `rewarded_only`."""
        return [t for t in self.traces(untrained=True) if t["rewards"] or not rewarded_only]

    def close(self) -> None:
        with self.lock:
            self.db.close()
