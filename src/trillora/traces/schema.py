"""The trace store's tables, and how one request's calls become their rows.

A served request is one `requests` row (its prompts, settings, trace, user and revision, stored
once) and one `choices` row per choice (its completion ids, logprobs, finish reason and tool calls):
a request of 64 prompts × n=64 keeps its prompts and its 63 stop ids once, not 4,096 times.
`usage` holds what each key's traffic keeps (choices and bytes of text), for the per-key budgets;
`pending` holds the traces no revision has trained on yet (`rewarded` once one has feedback), so
the learner reads what can train through an index, never every row a key ever sent.

Version 1 stores (one `calls` table, a row per choice repeating its prompt) are moved to this
layout the first time a server opens them, in one transaction.
"""

from __future__ import annotations

import json
from dataclasses import fields

from .types import Call, TraceError

VERSION = 2
FEEDBACK_BYTES = "LENGTH(f.label) + LENGTH(f.comment) + 64"
"""What a feedback row counts in its key's usage: its label and comment as the database measures
them, and 64 for its ids, reward and time (charged and given back by the same expression)."""

REQUEST_COLUMNS = (
    "response_id",
    "trace_id",
    "owner",
    "model",
    "revision",
    "kind",
    "prompts",
    "params",
    "user_id",
    "tag",
    "created",
    "calls",
    "bytes",
)
CHOICE_COLUMNS = ("response_id", "choice", "prompt", "completion_ids", "logprobs", "tool_calls", "finish_reason")
SHARED = ("trace_id", "owner", "model", "revision", "kind", "params", "user_id", "tag")
"""What every choice of one request holds alike (stored once, on the request)."""
_CALL_FIELDS = tuple(f.name for f in fields(Call))

TABLES = (
    "CREATE TABLE IF NOT EXISTS requests (response_id TEXT PRIMARY KEY, trace_id TEXT NOT NULL, owner TEXT NOT NULL, "
    "model TEXT NOT NULL, revision TEXT NOT NULL, kind TEXT NOT NULL, prompts TEXT NOT NULL, params TEXT NOT NULL, "
    "user_id TEXT NOT NULL, tag TEXT NOT NULL, created DOUBLE PRECISION NOT NULL, calls INTEGER NOT NULL, "
    "bytes BIGINT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS requests_trace ON requests (owner, trace_id, created)",
    "CREATE TABLE IF NOT EXISTS choices (response_id TEXT NOT NULL, choice INTEGER NOT NULL, prompt INTEGER NOT NULL, "
    "completion_ids TEXT NOT NULL, logprobs TEXT NOT NULL, tool_calls TEXT NOT NULL, finish_reason TEXT NOT NULL, "
    "PRIMARY KEY (response_id, choice))",
    "CREATE TABLE IF NOT EXISTS feedback (trace_id TEXT NOT NULL, owner TEXT NOT NULL, reward DOUBLE PRECISION "
    "NOT NULL, response_id TEXT NOT NULL, label TEXT NOT NULL, comment TEXT NOT NULL, "
    "created DOUBLE PRECISION NOT NULL)",
    "CREATE INDEX IF NOT EXISTS feedback_trace ON feedback (owner, trace_id)",
    "CREATE TABLE IF NOT EXISTS trained (owner TEXT NOT NULL, trace_id TEXT NOT NULL, revision INTEGER NOT NULL, "
    "created DOUBLE PRECISION NOT NULL, PRIMARY KEY (owner, trace_id))",
    "CREATE INDEX IF NOT EXISTS trained_revision ON trained (revision, created)",
    "CREATE TABLE IF NOT EXISTS pending (owner TEXT NOT NULL, trace_id TEXT NOT NULL, rewarded INTEGER NOT NULL, "
    "PRIMARY KEY (owner, trace_id))",
    "CREATE INDEX IF NOT EXISTS pending_rewarded ON pending (rewarded)",
    "CREATE TABLE IF NOT EXISTS usage (owner TEXT PRIMARY KEY, calls BIGINT NOT NULL, bytes BIGINT NOT NULL)",
)


def _insert(table: str, columns: tuple[str, ...]) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


_INSERT_REQUEST, _INSERT_CHOICE = _insert("requests", REQUEST_COLUMNS), _insert("choices", CHOICE_COLUMNS)
PENDING = (  # a trace already trained on never comes back (new calls in it stay out, as before)
    "INSERT INTO pending (owner, trace_id, rewarded) SELECT ?, ?, ? WHERE NOT EXISTS "
    "(SELECT 1 FROM trained t WHERE t.owner = ? AND t.trace_id = ?) "
    "ON CONFLICT (owner, trace_id) DO UPDATE SET rewarded = MAX_REWARDED"
)
USAGE_FEEDBACK = (
    "INSERT INTO usage (owner, calls, bytes) SELECT ?, 0, "
    + FEEDBACK_BYTES
    + " FROM (SELECT ? AS label, ? AS comment) f "
    "WHERE true ON CONFLICT (owner) DO UPDATE SET bytes = usage.bytes + excluded.bytes"
)
USAGE = (
    "INSERT INTO usage (owner, calls, bytes) VALUES (?, ?, ?) "
    "ON CONFLICT (owner) DO UPDATE SET calls = usage.calls + excluded.calls, bytes = usage.bytes + excluded.bytes"
)


def pending_statement(postgres: bool) -> str:
    """The upsert keeping a trace's `rewarded` flag once set (SQLite's two-argument MAX is GREATEST there)."""
    most = "GREATEST" if postgres else "MAX"
    return PENDING.replace("MAX_REWARDED", f"{most}(pending.rewarded, excluded.rewarded)")


def _size(values) -> int:
    return sum(len(v.encode()) if isinstance(v, str) else 8 for v in values)


def record_statements(calls: list[Call], postgres: bool) -> list[tuple[str, list[tuple]]]:
    """One transaction's statements for these calls: a request row per response id, a choice row per
    call, each trace pending, each key's usage grown by what it stored."""
    requests: dict[str, list[Call]] = {}
    for c in calls:
        requests.setdefault(c.response_id, []).append(c)
    request_rows, choice_rows, pending, usage = [], [], {}, {}
    for response_id, group in requests.items():
        first = group[0]
        for c in group:
            if any(getattr(c, k) != getattr(first, k) for k in SHARED):
                differ = [k for k in SHARED if getattr(c, k) != getattr(first, k)]
                raise TraceError(f"response {response_id!r}: its choices differ in {', '.join(differ)}")
        prompts: list[list[int]] = []
        index: dict[tuple[int, ...], int] = {}
        rows = []
        for c in group:
            at = index.setdefault(tuple(c.prompt_ids), len(prompts))
            if at == len(prompts):
                prompts.append(list(c.prompt_ids))
            lists = (json.dumps(c.completion_ids), json.dumps(c.logprobs), json.dumps(c.tool_calls))
            rows.append((response_id, c.choice, at, *lists, c.finish_reason))
        head = (
            response_id,
            first.trace_id,
            first.owner,
            first.model,
            first.revision,
            first.kind,
            json.dumps(prompts),
            json.dumps(first.params),
            first.user_id,
            first.tag,
            first.created,
        )
        size = _size(head) + sum(_size(r) for r in rows)
        request_rows.append((*head, len(group), size))
        choice_rows += rows
        pending[first.owner, first.trace_id] = None
        calls_, bytes_ = usage.get(first.owner, (0, 0))
        usage[first.owner] = (calls_ + len(group), bytes_ + size)
    return [
        (_INSERT_REQUEST, request_rows),
        (_INSERT_CHOICE, choice_rows),
        (pending_statement(postgres), [(o, t, 0, o, t) for o, t in pending]),
        (USAGE, [(o, n, b) for o, (n, b) in usage.items()]),
    ]


CALL_SELECT = (
    "SELECT r.response_id, c.choice, r.trace_id, r.owner, r.model, r.revision, r.kind, r.prompts, c.prompt, "
    "c.completion_ids, c.logprobs, r.params, c.finish_reason, c.tool_calls, r.user_id, r.tag, r.created "
    "FROM requests r JOIN choices c ON c.response_id = r.response_id"
)


def call_of(row: tuple) -> Call:
    """A `CALL_SELECT` row as the call it recorded."""
    rid, choice, trace, owner, model, revision, kind, prompts, at, ids, lps, params, reason, tools, user, tag, t = row
    return Call(
        rid,
        choice,
        trace,
        owner,
        model,
        revision,
        kind,
        json.loads(prompts)[at],
        json.loads(ids),
        json.loads(lps),
        json.loads(params),
        reason,
        json.loads(tools),
        user,
        tag,
        t,
    )


_V1_LISTS = ("prompt_ids", "completion_ids", "logprobs", "params", "tool_calls")


def migrate_v1(cur, postgres: bool) -> None:
    """A version 1 store's `calls` rows moved into requests and choices (within the caller's
    transaction); its untrained traces pending, its keys' usage counted, feedback included."""
    cur.execute(f"SELECT {', '.join(_CALL_FIELDS)} FROM calls ORDER BY response_id, choice")
    old = [
        Call(**{k: json.loads(v) if k in _V1_LISTS else v for k, v in zip(_CALL_FIELDS, r, strict=True)})
        for r in cur.fetchall()
    ]
    sql = (lambda s: s.replace("?", "%s")) if postgres else (lambda s: s)
    for text, rows in record_statements(old, postgres):
        if rows:
            cur.executemany(sql(text), rows)
    cur.execute(
        "UPDATE pending SET rewarded = 1 WHERE EXISTS "
        "(SELECT 1 FROM feedback f WHERE f.owner = pending.owner AND f.trace_id = pending.trace_id)"
    )
    cur.execute(
        f"UPDATE usage SET bytes = bytes + (SELECT COALESCE(SUM({FEEDBACK_BYTES}), 0) FROM feedback f "
        "WHERE f.owner = usage.owner)"
    )
    cur.execute("DROP TABLE calls")
