"""The trace store: every served call and every piece of feedback, in SQLite or PostgreSQL.

One schema and one set of queries for both. SQLite is the embedded default: WAL with
`synchronous=FULL`, so a call whose commit returned is on disk before its response is sent, and
survives a kill -9 of the server (and a power cut). PostgreSQL, named by a `postgresql://` URL, is
the same store shared by several servers on several machines (each commit is durable when it
returns, PostgreSQL's default).

A call is one choice of one served request: the exact prompt and completion token ids and the
completion's per-token logprobs as the engine sampled them, the revision that served it, the
sampling settings, the parsed tool calls (stored as a request row and a choice row: `schema`).
Token lists are stored as JSON text: portable between the two databases and readable with any SQL
client. `owner` is a digest of the API key whose traffic it was: feedback and reads are answered
only for the owner's own traces, and each key's usage is counted against its budget.
"""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from dataclasses import asdict, fields
from pathlib import Path
from urllib.parse import urlsplit

from . import schema
from .types import (
    HELD_OUT,
    MAX_FEEDBACK,
    MAX_REWARD,
    Call,
    Feedback,
    OverBudget,
    TooMuchFeedback,
    TraceError,
    UnknownTrace,
)

_FEEDBACK_COLUMNS = tuple(f.name for f in fields(Feedback))
_NOT_TRAINED = "NOT EXISTS (SELECT 1 FROM trained t WHERE t.owner = p.owner AND t.trace_id = p.trace_id)"
"""A pending trace another server's record made pending again while it was being marked trained."""
_TRACE_FIELDS = ("owner", "trace_id", "user_id", "calls", "first", "last", "rewards", "mean_reward")
_SUMMARY = (  # one row per trace of `requests r`: its choices, first and last call, feedback
    "SELECT r.owner, r.trace_id, MIN(r.user_id), SUM(r.calls), MIN(r.created), MAX(r.created), "
    "(SELECT COUNT(*) FROM feedback f WHERE f.owner = r.owner AND f.trace_id = r.trace_id), "
    "(SELECT AVG(f.reward) FROM feedback f WHERE f.owner = r.owner AND f.trace_id = r.trace_id) "
)


class TraceStore:
    def __init__(self, where: str, busy_seconds: float = 1.0):
        """`where`: a SQLite file path, or a `postgresql://` URL. `busy_seconds`: how long a write
        waits for a lock held elsewhere before it fails (a failed write is the caller's to count)."""
        self.where, self.lock, self.busy_seconds = where, threading.Lock(), busy_seconds
        self.postgres = where.startswith(("postgresql://", "postgres://"))
        try:
            self.db = self._connect()
            self._open()
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

    def _open(self) -> None:
        """The tables made, or a version 1 store moved to them (`schema.migrate_v1`), in one transaction."""
        cur = self.db.cursor()
        cur.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
        cur.execute(self._sql("SELECT value FROM meta WHERE name = ?"), ("schema",))
        if cur.fetchone() is None:
            listed = (
                "SELECT 1 FROM information_schema.tables WHERE table_schema = current_schema() AND table_name = 'calls'"
                if self.postgres
                else "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'calls'"
            )
            legacy = cur.execute(listed).fetchone() is not None
            for statement in schema.TABLES:
                cur.execute(statement)
            if legacy:
                schema.migrate_v1(cur, self.postgres)
            made = "INSERT INTO meta (name, value) VALUES (?, ?) ON CONFLICT (name) DO NOTHING"  # another server's too
            cur.execute(self._sql(made), ("schema", str(schema.VERSION)))
        self.db.commit()

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

    def _write(self, statements: list[tuple[str, list[tuple]]]) -> None:
        """Statements over many rows each, in one transaction."""
        self._run(statements, None)

    def _read(self, text: str, args: tuple = ()) -> list[tuple]:
        return self._run([], (text, args))

    def _run(self, writes: list[tuple[str, list[tuple]]], read: tuple[str, tuple] | None) -> list[tuple]:
        """One transaction: writes over many rows, or a read (its commit ends PostgreSQL's read
        transaction, so later reads see new rows)."""
        with self.lock:
            try:
                cur = self._cursor()
                for text, rows in writes:
                    if rows:
                        cur.executemany(self._sql(text), rows)
                if read is not None:
                    cur.execute(self._sql(read[0]), read[1])
                rows = [] if read is None else cur.fetchall()
                self.db.commit()
                return rows
            except Exception:
                if not (self.postgres and self.db.closed):
                    self.db.rollback()
                raise

    # --- writes -------------------------------------------------------------------------------
    def record(self, calls: list[Call]) -> None:
        """Requests' choices (a request's prompts and settings stored once), in one transaction:
        durable when this returns."""
        self._write(schema.record_statements(calls, self.postgres))

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
        found = self._read(f"SELECT trace_id FROM requests WHERE owner = ? AND {where} LIMIT 1", args)
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
            [
                (
                    f"INSERT INTO feedback ({', '.join(_FEEDBACK_COLUMNS)}) "
                    f"VALUES ({', '.join('?' * len(_FEEDBACK_COLUMNS))})",
                    [tuple(d[k] for k in _FEEDBACK_COLUMNS)],
                ),
                (schema.pending_statement(self.postgres), [(*same, 1, *same)]),
                (schema.USAGE_FEEDBACK, [(fb.owner, fb.label, fb.comment)]),  # measured as `delete` measures it
            ]
        )

    def delete(self, older_than: float | None = None, user_id: str | None = None, trace_id: str | None = None) -> int:
        """Traces whose last call is older than `older_than` seconds, or whose calls came from
        `user_id`, or the one trace: their calls and feedback, and what they counted in their
        key's usage. Returns how many traces went."""
        if older_than is None and user_id is None and trace_id is None:
            raise TraceError("delete needs an age, a user id or a trace id (nothing is deleted without one)")
        keys = sorted(
            {
                (t["owner"], t["trace_id"])
                for t in self.traces(older_than=older_than, user_id=user_id, trace_id=trace_id)
            }
        )
        same = "WHERE owner = ? AND trace_id = ?"
        kept = (  # what one trace counted in its key's usage, read in the transaction that deletes it
            "(SELECT COALESCE(SUM(r.calls), 0) FROM requests r WHERE r.owner = ? AND r.trace_id = ?)",
            f"(SELECT COALESCE(SUM(r.bytes), 0) FROM requests r WHERE r.owner = ? AND r.trace_id = ?) + "
            f"(SELECT COALESCE(SUM({schema.FEEDBACK_BYTES}), 0) FROM feedback f WHERE f.owner = ? AND f.trace_id = ?)",
        )
        self._write(
            [
                (
                    f"UPDATE usage SET calls = calls - {kept[0]}, bytes = bytes - ({kept[1]}) WHERE owner = ?",
                    [(o, t, o, t, o, t, o) for o, t in keys],
                ),
                (f"DELETE FROM choices WHERE response_id IN (SELECT response_id FROM requests {same})", keys),
                *((f"DELETE FROM {table} {same}", keys) for table in ("requests", "feedback", "trained", "pending")),
            ]
        )
        return len(keys)

    # --- reads --------------------------------------------------------------------------------
    def calls(self, trace_id: str, owner: str | None = None) -> list[Call]:
        """A trace's calls in the order they were served (one owner's only, when given)."""
        mine, args = ("", (trace_id,)) if owner is None else (" AND r.owner = ?", (trace_id, owner))
        rows = self._read(
            f"{schema.CALL_SELECT} WHERE r.trace_id = ?{mine} ORDER BY r.created, r.response_id, c.choice", args
        )
        return [schema.call_of(r) for r in rows]

    def feedback(self, trace_id: str, owner: str | None = None) -> list[Feedback]:
        mine, args = ("", (trace_id,)) if owner is None else (" AND owner = ?", (trace_id, owner))
        rows = self._read(
            f"SELECT {', '.join(_FEEDBACK_COLUMNS)} FROM feedback WHERE trace_id = ?{mine} ORDER BY created", args
        )
        return [Feedback(**dict(zip(_FEEDBACK_COLUMNS, r, strict=True))) for r in rows]

    def traces(
        self, older_than: float | None = None, user_id: str | None = None, trace_id: str | None = None
    ) -> list[dict]:
        """One summary per trace (a key's trace id: two keys naming the same id hold two traces):
        owner, id, user, calls, first and last call time, rewards given and their mean."""
        where, args = [], []
        if user_id is not None:
            where, args = where + ["r.user_id = ?"], args + [user_id]
        if trace_id is not None:
            where, args = where + ["r.trace_id = ?"], args + [trace_id]
        query = _SUMMARY + "FROM requests r" + (" WHERE " + " AND ".join(where) if where else "")
        query += " GROUP BY r.owner, r.trace_id"
        if older_than is not None:
            query, args = query + " HAVING MAX(r.created) < ?", args + [time.time() - older_than]
        rows = self._read(query + " ORDER BY MIN(r.created)", tuple(args))
        return [dict(zip(_TRACE_FIELDS, r, strict=True)) for r in rows]

    def usage(self, owner: str) -> tuple[int, int]:
        """What one key's recorded traffic keeps: (choices, bytes of text, its feedback's included)."""
        found = self._read("SELECT calls, bytes FROM usage WHERE owner = ?", (owner,))
        return (int(found[0][0]), int(found[0][1])) if found else (0, 0)

    def check_budget(self, owner: str, max_calls: int, max_bytes: int) -> None:
        """OverBudget once a key's recorded traffic holds `max_calls` choices or `max_bytes` bytes."""
        calls, size = self.usage(owner)
        if calls >= max_calls or size >= max_bytes:
            raise OverBudget(
                f"this key's recorded traffic holds {calls} choices and {size / 2**20:.3g} MiB, its budget "
                f"(--max-trace-rows {max_calls}, --max-trace-mib {max_bytes / 2**20:g}); the operator frees "
                "it with `trillora traces delete`"
            )

    def mark_trained(self, keys: list[tuple[str, str]], revision: int) -> None:
        """The learner's record that these traces ((owner, trace id)) went into `revision` (-1: left
        out for good, `HELD_OUT`: kept for a gate); none is trained on twice."""
        self._write(
            [
                (  # another server's record may have made a trained trace pending again meanwhile: no twice
                    "INSERT INTO trained (owner, trace_id, revision, created) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (owner, trace_id) DO NOTHING",
                    [(o, t, revision, time.time()) for o, t in keys],
                ),
                ("DELETE FROM pending WHERE owner = ? AND trace_id = ?", keys),
            ]
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
        those with feedback when `rewarded_only`. Read through `pending`: a key's traces that
        nobody rewards are never walked (the learner asks every second)."""
        rows = self._read(
            _SUMMARY + "FROM pending p CROSS JOIN requests r "  # SQLite: walk `pending` first, as PostgreSQL would
            f"WHERE p.rewarded >= ? AND r.owner = p.owner AND r.trace_id = p.trace_id AND {_NOT_TRAINED} "
            "GROUP BY r.owner, r.trace_id ORDER BY MIN(r.created)",
            (int(rewarded_only),),
        )
        return [dict(zip(_TRACE_FIELDS, r, strict=True)) for r in rows]

    def untrained_count(self, rewarded_only: bool) -> int:
        """How many traces `untrained` would give (one indexed count)."""
        [(n,)] = self._read(
            f"SELECT COUNT(*) FROM pending p WHERE p.rewarded >= ? AND {_NOT_TRAINED}", (int(rewarded_only),)
        )
        return int(n)

    def close(self) -> None:
        with self.lock:
            self.db.close()
