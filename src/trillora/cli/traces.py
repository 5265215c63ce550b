"""`trillora traces STORE list | export | delete`: what `serve --record` wrote.

trillora traces runs/traces.db list [--user ID] [--older-than 7d] [--json]
trillora traces runs/traces.db export --out traces.jsonl      (or .parquet: one row per trace)
trillora traces postgresql://trillora@db/traces delete --older-than 30d
trillora traces runs/traces.db delete --user alice
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict
from pathlib import Path

from ..errors import ConfigError

AGE = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def age_seconds(text: str) -> float:
    """`90`, `90s`, `15m`, `12h`, `30d` in seconds."""
    m = AGE.fullmatch(text.strip())
    if m is None:
        raise ConfigError(f"--older-than {text!r}: a number of seconds, or a number with s, m, h or d (30d)")
    return float(m.group(1)) * SECONDS[m.group(2)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="the trace store serve --record wrote: a SQLite file or a postgresql:// URL")
    p.add_argument("action", choices=["list", "export", "delete"])
    p.add_argument("--user", default=None, help="only the traces of this user id (OpenAI's `user` field)")
    p.add_argument("--older-than", default=None, help="only traces whose last call is older than this (30d, 12h, 90m)")
    p.add_argument("--trace", default=None, help="delete: this one trace")
    p.add_argument("--out", default=None, help="export: a .jsonl or .parquet file")
    p.add_argument("--json", action="store_true", help="list: one JSON object per trace")


def trace_rows(store, selected: list[dict]) -> list[dict]:
    """One row per trace: its summary, its calls in order (token ids, logprobs, revision), its feedback."""
    rows = []
    for t in selected:
        calls = [asdict(c) for c in store.calls(t["trace_id"], owner=t["owner"])]
        for c in calls:
            c.pop("owner")  # a key's digest: who may score it, not part of the data
        feedback = [
            {k: v for k, v in asdict(f).items() if k != "owner"} for f in store.feedback(t["trace_id"], t["owner"])
        ]
        rows.append({**{k: v for k, v in t.items() if k != "owner"}, "records": calls, "feedback": feedback})
    return rows


def cmd_traces(args: argparse.Namespace) -> int:
    from ..traces import TraceStore

    older = age_seconds(args.older_than) if args.older_than is not None else None
    if args.action == "delete":
        if older is None and args.user is None and args.trace is None:
            raise ConfigError(
                "trillora traces delete needs --older-than, --user or --trace (nothing is deleted without one)"
            )
        store = TraceStore(args.store)
        print(
            f"deleted {store.delete(older_than=older, user_id=args.user, trace_id=args.trace)} traces from "
            f"{store.shown}"
        )
        return 0
    if args.trace is not None:
        raise ConfigError("--trace goes with delete; list and export select with --user and --older-than")
    store = TraceStore(args.store)
    selected = store.traces(older_than=older, user_id=args.user)
    if args.action == "list":
        for t in selected:
            if args.json:
                print(json.dumps({k: v for k, v in t.items() if k != "owner"}))
            else:
                reward = "-" if t["mean_reward"] is None else f"{t['mean_reward']:.3f}"
                print(
                    f"{t['trace_id']}  user={t['user_id'] or '-'}  calls={t['calls']}  rewards={t['rewards']}  "
                    f"mean_reward={reward}"
                )
        return 0
    if args.out is None or Path(args.out).suffix not in (".jsonl", ".parquet"):
        raise ConfigError(f"export needs --out FILE ending in .jsonl or .parquet, not {args.out!r}")
    rows, out = trace_rows(store, selected), Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".jsonl":
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError("a .parquet export needs pyarrow (pip install pyarrow); .jsonl needs nothing") from None
        for r in rows:  # settings and tool calls vary in shape from call to call: JSON text in a column
            for c in r["records"]:
                c["params"], c["tool_calls"] = json.dumps(c["params"]), json.dumps(c["tool_calls"])
        pq.write_table(pa.Table.from_pylist(rows), out)
    print(f"exported {len(rows)} traces to {out}")
    return 0
