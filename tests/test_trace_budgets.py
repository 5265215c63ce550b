"""What a key's recorded traffic makes the server keep: a request's prompt and settings stored once,
each key's choices and bytes under its budget (403 past it, others served on), the learner's scan
reading only what can train, and a version 1 store moved to the new tables without a loss."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time

import pytest
from engine_helpers import post_json, running_server
from pg_server import postgres_server

from trillora.cli import main
from trillora.serve.config import ServeConfig
from trillora.traces import Call, Feedback, TraceStore


@pytest.fixture(scope="module")
def postgres():
    yield from postgres_server()


def request_calls(rid: str, trace: str, owner: str, prompts: list[list[int]], n: int, tokens: int) -> list[Call]:
    """One served request as the routes record it: n choices of each prompt, one settings dict."""
    params = {"temperature": 1.0, "stop": list(range(1000, 1063)), "max_tokens": tokens, "n": n}
    out, now = [], time.time()
    for i in range(len(prompts) * n):
        completion = [(7 * i + j) % 500 for j in range(tokens)]
        out.append(
            Call(rid, i, trace, owner, "tiny", "tiny", "completion", list(prompts[i // n]), completion,
                 [-0.123456789 - j for j in range(tokens)], dict(params), "length", [], "u" * 256, created=now)
        )  # fmt: skip
    return out


def on_disk(path) -> int:
    return sum(os.path.getsize(f"{path}{s}") for s in ("", "-wal") if os.path.exists(f"{path}{s}"))


def test_a_request_keeps_its_prompts_and_settings_once(tmp_path):
    """64 prompts × n=64 × 16 tokens, the call cap the attacker used: stored as one request row and
    4,096 choice rows. What the key is charged and what the file grows by are the completions, the
    64 prompts and one settings dict, not 4,096 copies of the prompt, the 63 stop ids and the user."""
    store = TraceStore(str(tmp_path / "t.db"))
    prompts = [[(p * 31 + j) % 500 for j in range(40)] for p in range(64)]
    before = on_disk(tmp_path / "t.db")
    calls = request_calls("cmpl-1", "t", "guest", prompts, 64, 16)
    store.record(calls)
    assert store.calls("t", owner="guest") == calls  # every choice comes back with its own prompt
    each = [len(json.dumps(c.completion_ids)) + len(json.dumps(c.logprobs)) for c in calls]
    once = sum(len(json.dumps(p)) + 2 for p in prompts) + len(json.dumps(calls[0].params)) + 256
    repeated = len(calls) * (len(json.dumps(prompts[0])) + len(json.dumps(calls[0].params)) + 256)
    choices, size = store.usage("guest")
    assert choices == 4096 and sum(each) < size < sum(each) + once + 4096 * 40
    assert size < (sum(each) + repeated) / 2  # the old layout kept 2.2× this
    assert on_disk(tmp_path / "t.db") - before < 1.5 * size  # the file grows by about what is charged
    store.close()


def test_usage_is_counted_per_key_and_freed_with_the_traces(store_at, tmp_path):
    store = TraceStore(store_at)
    store.record(request_calls("r1", "a", "k1", [[1, 2, 3]], 2, 4))
    store.record(request_calls("r2", "b", "k1", [[1, 2, 3, 4]], 1, 4))
    store.record(request_calls("r3", "a", "k2", [[5]], 3, 4))
    k1, k2 = store.usage("k1"), store.usage("k2")
    assert (k1[0], k2[0], store.usage("nobody")) == (3, 3, (0, 0))
    store.add_feedback(Feedback("a", "k1", 1.0, comment="x" * 1000))  # feedback is charged too
    assert store.usage("k1") == (3, k1[1] + 1000 + 64)
    store.check_budget("k1", 4, 1 << 20)
    with pytest.raises(Exception, match=r"holds 3 choices .* \(--max-trace-rows 3, --max-trace-mib 1\)"):
        store.check_budget("k1", 3, 1 << 20)
    with pytest.raises(Exception, match=r"and 0.00\d+ MiB, .*--max-trace-mib 0.00095"):
        store.check_budget("k1", 100, 1000)
    assert store.delete(trace_id="a") == 2  # both keys' trace "a": each key is given its own back
    alone = TraceStore(str(tmp_path / "alone.db"))
    alone.record(request_calls("r2", "b", "k1", [[1, 2, 3, 4]], 1, 4))
    assert store.usage("k2") == (0, 0) and store.usage("k1") == alone.usage("k1")  # what r2 alone keeps
    alone.close()
    nul = "\x00" if "://" not in store_at else ""  # (the routes refuse it: PostgreSQL's text holds none)
    store.add_feedback(Feedback("b", "k1", 1.0, label="é", comment=f"a{nul}" * 100))  # as the database measures it
    assert store.delete(trace_id="b") == 1 and store.usage("k1") == (0, 0)  # everything given back, nothing more
    store.close()


def test_a_trace_made_pending_again_while_it_was_marked_trained_is_not_trained_twice(store_at):
    """Servers sharing a PostgreSQL store: a record committed while the learner marks its trace
    trained leaves a stale `pending` row (the record checked `trained` before the mark committed).
    The learner neither reads it nor fails on it, and the next mark clears it."""
    store = TraceStore(store_at)
    store.record(request_calls("r1", "t1", "k", [[1, 2]], 1, 2))
    store.add_feedback(Feedback("t1", "k", 1.0))
    store.mark_trained([("k", "t1")], 1)
    store._write([("INSERT INTO pending (owner, trace_id, rewarded) VALUES (?, ?, ?)", [("k", "t1", 1)])])
    assert store.untrained(rewarded_only=True) == [] and store.untrained_count(rewarded_only=False) == 0
    store.mark_trained([("k", "t1")], 2)  # no second `trained` row, no error; the stale row goes
    assert store._read("SELECT revision FROM trained") == [(1,)] and store._read("SELECT * FROM pending") == []
    store.close()


@pytest.fixture(params=["sqlite", "postgres"])
def store_at(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "traces.db")
    import psycopg

    url, name = request.getfixturevalue("postgres"), f"b_{abs(hash(request.node.name)) % 10**8}"
    with psycopg.connect(url, autocommit=True) as db:
        db.execute(f"DROP DATABASE IF EXISTS {name}")
        db.execute(f"CREATE DATABASE {name}")
    return url.rsplit("/", 1)[0] + "/" + name


def steps_of(store: TraceStore, read) -> int:
    """SQLite virtual-machine steps a read takes: the work, not the time."""
    steps = [0]

    def count():
        steps[0] += 1

    store.db.set_progress_handler(count, 1)
    try:
        read()
    finally:
        store.db.set_progress_handler(None, 1)
    return steps[0]


def test_the_learners_scan_reads_only_what_can_train(tmp_path):
    """A guest's unrewarded traces, however many, cost the learner's once-a-second scan nothing:
    the scan walks the pending traces with feedback, through an index."""
    store = TraceStore(str(tmp_path / "t.db"))
    for i in range(3):
        store.record(request_calls(f"op-{i}", f"op-{i}", "operator", [[1, 2, 3]], 1, 4))
        store.add_feedback(Feedback(f"op-{i}", "operator", 1.0))
    cost = {}
    for guests in (100, 3000):
        store.record([c for i in range(len(cost) * 100, guests) for c in request_calls(f"g-{i}", f"g-{i}", "guest",
                                                                                      [[4, 5, 6]], 1, 4)])  # fmt: skip
        cost[guests] = (
            steps_of(store, lambda: store.untrained(rewarded_only=True)),
            steps_of(store, lambda: store.untrained_count(rewarded_only=True)),
        )
        assert [t["trace_id"] for t in store.untrained(rewarded_only=True)] == ["op-0", "op-1", "op-2"]
        assert store.untrained_count(rewarded_only=False) == 3 + guests
    assert cost[3000] == cost[100]  # 30× the guest's rows, the same work (the old scan: 9.4k steps, then 273k)
    store.mark_trained([("operator", "op-0")], 1)
    store.record(request_calls("op-0b", "op-0", "operator", [[1]], 1, 1))  # a trained trace goes on: stays out
    store.add_feedback(Feedback("op-0", "operator", 0.0))
    assert [t["trace_id"] for t in store.untrained(rewarded_only=True)] == ["op-1", "op-2"]
    store.close()


V1 = (
    "CREATE TABLE calls (response_id TEXT NOT NULL, choice INTEGER NOT NULL, trace_id TEXT NOT NULL, "
    "owner TEXT NOT NULL, model TEXT NOT NULL, revision TEXT NOT NULL, kind TEXT NOT NULL, prompt_ids TEXT NOT NULL, "
    "completion_ids TEXT NOT NULL, logprobs TEXT NOT NULL, params TEXT NOT NULL, tool_calls TEXT NOT NULL, "
    "finish_reason TEXT NOT NULL, user_id TEXT NOT NULL, tag TEXT NOT NULL, created DOUBLE PRECISION NOT NULL, "
    "PRIMARY KEY (response_id, choice))",
    "CREATE TABLE feedback (trace_id TEXT NOT NULL, owner TEXT NOT NULL, reward DOUBLE PRECISION NOT NULL, "
    "response_id TEXT NOT NULL, label TEXT NOT NULL, comment TEXT NOT NULL, created DOUBLE PRECISION NOT NULL)",
    "CREATE TABLE trained (owner TEXT NOT NULL, trace_id TEXT NOT NULL, revision INTEGER NOT NULL, "
    "created DOUBLE PRECISION NOT NULL, PRIMARY KEY (owner, trace_id))",
)


def test_a_version_1_store_is_moved_to_the_new_tables_with_nothing_lost(tmp_path):
    """A store written by the previous release (one row per choice, its prompt repeated): its calls,
    feedback and training marks read back the same, and its keys' usage is counted."""
    path = tmp_path / "v1.db"
    db = sqlite3.connect(path)
    for statement in V1:
        db.execute(statement)
    calls = request_calls("r1", "a", "k1", [[1, 2], [3]], 2, 3) + request_calls("r2", "b", "k2", [[9]], 1, 2)
    calls += request_calls("r3", "c", "k1", [[8]], 1, 2)
    for c in calls:
        d = {**c.__dict__}
        d.update({k: json.dumps(d[k]) for k in ("prompt_ids", "completion_ids", "logprobs", "params", "tool_calls")})
        db.execute(f"INSERT INTO calls ({', '.join(d)}) VALUES ({', '.join('?' * len(d))})", tuple(d.values()))
    db.execute("INSERT INTO feedback VALUES ('a', 'k1', 1.0, '', 'up', '', ?)", (time.time(),))
    db.execute("INSERT INTO trained VALUES ('k1', 'c', 3, ?)", (time.time(),))
    db.commit()
    db.close()
    store = TraceStore(str(path))
    assert store.calls("a") + store.calls("b") + store.calls("c") == calls
    assert [t["trace_id"] for t in store.untrained(rewarded_only=True)] == ["a"]
    assert [t["trace_id"] for t in store.untrained(rewarded_only=False)] == ["a", "b"]  # c was trained
    assert store.usage("k1")[0] == 5 and store.usage("k2")[0] == 1 and store.usage("k1")[1] > 66
    assert not store._read("SELECT name FROM sqlite_master WHERE name = 'calls'")
    store.close()
    assert TraceStore(str(path)).calls("a") == calls[:4]  # opened again: nothing moved twice


@pytest.mark.slow
def test_a_key_past_its_trace_budget_is_refused_and_the_others_served(tmp_path):
    """A guest key sending the largest requests it may: refused with 403 naming the budget once its
    recorded traffic holds it, the store's file bounded by it; the operator's completions and
    feedback go on, and `trillora traces delete` gives the guest room again."""
    db = tmp_path / "t.db"
    cfg = ServeConfig(model="tiny-moe-chat", port=0, api_key=["op", "guest"], record=str(db), max_trace_mib=0.25)
    gen = running_server(cfg)
    url = f"http://127.0.0.1:{next(gen).cfg.port}"
    flood = {"prompt": [[5] * 8] * 8, "n": 16, "max_tokens": 16, "user": "u" * 256}
    codes, sent = [], 0
    while not codes or codes[-1] == 200:
        status, out = post_json(url, "/v1/completions", flood, key="guest")
        codes.append(status)
        sent += 1
        assert sent < 100, "never refused"
    message = out["error"]["message"]
    assert status == 403 and "--max-trace-mib 0.25" in message and "trillora traces delete" in message
    checkpoint = sqlite3.connect(db)  # the write-ahead log folded in: what the store keeps, not its journal
    checkpoint.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    checkpoint.close()
    choices, kept = TraceStore(str(db)).usage(hashlib.sha256(b"guest").hexdigest()[:16])
    assert choices == 128 * (len(codes) - 1) and 0.25 * 2**20 <= kept < 0.25 * 2**20 + kept / (len(codes) - 1)
    assert on_disk(db) < 1.5 * kept + 64 * 2**10  # the budget, one request over it, the tables' pages
    status, op = post_json(url, "/v1/completions", {"prompt": "1+1=", "max_tokens": 2}, key="op")
    assert (
        status == 200
        and post_json(url, "/v1/feedback", {"trace_id": op["trace_id"], "reward": 1.0}, key="op")[0] == 200
    )
    assert post_json(url, "/v1/feedback", {"trace_id": "x", "reward": 1.0}, key="guest")[0] == 403
    assert main(["traces", str(db), "delete", "--user", "u" * 256]) == 0
    assert post_json(url, "/v1/completions", flood, key="guest")[0] == 200
    next(gen, None)
