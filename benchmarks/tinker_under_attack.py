"""`serve --tinker` under attack: honest SDK clients keep working while hostile ones hammer the server.

    python benchmarks/tinker_under_attack.py [--clients 8] [--samplers 8] [--steps 6] [--model tiny-moe-chat]

One `trillora serve MODEL --tinker --record STORE --learn CONFIG` in a subprocess on loopback, with
three keys: the operator's, an honest one and a guest's. Honest: `--clients` training clients (the
real `tinker` SDK: forward_backward + optim_step per step) and `--samplers` sampling clients (n = 2
samples per step), all at once, and the operator's recorded, rewarded 4-token completions one after
another (`--operator-requests`). They run twice: alone, then under attack. Hostile, all the while:
- shapes: forward_backward bodies of 3 tokens whose `weights` declare [3, 50,000,000] values and send none;
- seq_id games: a replayed seq_id, a string seq_id, and calls on model ids of sessions never made;
- slow: 32 connections that send half a request line and nothing more, reopened once the server closes them;
- keyless: bodies announced at 64 MiB without the key, sent 1 MiB at a time;
- keyless slots: twice `--max-connections` idle connections without a key, reopened once closed;
- store flood (the guest key): the largest recorded completion a call may be (64 prompts × n=64),
  back to back; the honest clients start once its trace budget (`--max-trace-mib`) is full;
- metadata loop (the guest key): a new session and training client with 15 KB of run metadata, again and again.
The shapes and seq_id games use the honest clients' own key. Reported: every honest request
answered or not, each kind of attack refused or not, the operator's p99 latency alone and under
attack, the trace store's and the state folder's disk against their budgets, the server's resident
memory and what `/api/v1/healthz` said each time it was asked. Writes
benchmarks/results/tinker_under_attack.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from attack_budgets import disk_bytes, http, keyless_slots, metadata_loop, operator, p99, store_flood
from machine import machine
from rich.console import Console
from rich.table import Table

os.environ.setdefault("TINKER_TELEMETRY", "0")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
KEY = "tml-attack"
"""The honest SDK clients' key (the shapes and seq_id games use it too)."""
OPERATOR, GUEST = "tml-operator", "tml-guest"
LEARN = "[learn]\nevery = 1000000\n"
"""The learner asks the store for new rewarded traces every second and never trains (no compute in the way)."""
MEMORY_BOUND_MIB = 256
"""The stated bound: the server's peak resident memory over its own after warm-up."""


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def keyed_json(port: int, path: str, body: dict) -> tuple[int, dict]:
    status, raw = http(
        port, "POST", path, json.dumps(body).encode(), {"X-API-Key": KEY, "Content-Type": "application/json"}
    )
    return status, json.loads(raw)


# --- the honest clients -------------------------------------------------------------------------
def trainer(sc, model: str, tokenizer, steps: int, seed: int, out: dict) -> None:
    from tinker import types

    rng = random.Random(seed)
    try:
        tc = sc.create_lora_training_client(base_model=model, rank=8).result()
        for _ in range(steps):
            data = []
            for _ in range(8):
                a, b = rng.randint(100, 999), rng.randint(100, 999)
                prompt, answer = (
                    tokenizer.encode(f"{a}+{b}=", add_special_tokens=False),
                    tokenizer.encode(str(a + b), add_special_tokens=False),
                )
                tokens = prompt + answer
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": tokens[1:],
                            "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(answer),
                        },
                    )
                )
            fb, opt = tc.forward_backward(data, "cross_entropy"), tc.optim_step(types.AdamParams(learning_rate=3e-3))
            ok = "loss:sum" in fb.result().metrics and "grad_norm:mean" in (opt.result().metrics or {})
            out["ok" if ok else "failed"] += 2
    except Exception as e:  # noqa: BLE001 - an honest request that failed, counted and named
        out["failed"] += 1
        out["errors"].append(f"{type(e).__name__}: {str(e)[:200]}")


def sampler(sc, model: str, tokenizer, steps: int, seed: int, out: dict) -> None:
    from tinker import types

    try:
        client = sc.create_sampling_client(base_model=model).result()
        for i in range(steps):
            prompt = types.ModelInput.from_ints(tokenizer.encode(f"{seed}{i}+1=", add_special_tokens=False))
            r = client.sample(
                prompt=prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0)
            )
            out["ok" if len(r.result().sequences) == 2 else "failed"] += 1
    except Exception as e:  # noqa: BLE001
        out["failed"] += 1
        out["errors"].append(f"{type(e).__name__}: {str(e)[:200]}")


# --- the hostile ones ---------------------------------------------------------------------------
def shapes(port: int, stop: threading.Event, out: dict) -> None:
    from trillora.serve.tinker import wire

    sid = keyed_json(port, "/api/v1/create_session", {})[1]["session_id"]
    created = keyed_json(
        port,
        "/api/v1/create_model",
        {"session_id": sid, "model_seq_id": 0, "base_model": out["model"], "lora_config": {"rank": 1}},
    )[1]
    mid = keyed_json(port, "/api/v1/retrieve_future", {"request_id": created["request_id"]})[1]["model_id"]
    weights = wire.put_varint(3, 1) + wire.put_bytes(4, b"".join(wire._put_varint(n) for n in (3, 50_000_000)))
    targets = wire.put_varint(3, 2) + wire.put_bytes(1, bytes(24))
    entries = b"".join(
        wire.put_bytes(2, wire.put_bytes(1, k) + wire.put_bytes(2, v))
        for k, v in ((b"weights", weights), (b"target_tokens", targets))
    )
    datum = wire.put_bytes(1, wire.put_bytes(1, wire.put_bytes(1, bytes(12))))  # three token ids
    seq = 1
    while not stop.is_set():
        body = (
            wire.put_bytes(1, mid.encode())
            + wire.put_varint(2, seq)
            + wire.put_bytes(3, datum + entries)
            + wire.put_bytes(4, b"cross_entropy")
        )
        status, _ = http(
            port, "POST", "/api/v1/forward_backward", body, {"X-API-Key": KEY, "Content-Type": "application/x-protobuf"}
        )
        out["shapes"]["refused" if status == 400 else "accepted"] += 1
        seq += 1


def seq_games(port: int, stop: threading.Event, out: dict) -> None:
    sid = keyed_json(port, "/api/v1/create_session", {})[1]["session_id"]
    created = keyed_json(
        port,
        "/api/v1/create_model",
        {"session_id": sid, "model_seq_id": 0, "base_model": out["model"], "lora_config": {"rank": 1}},
    )[1]
    mid = keyed_json(port, "/api/v1/retrieve_future", {"request_id": created["request_id"]})[1]["model_id"]
    step = {"model_id": mid, "seq_id": 1, "adam_params": {"learning_rate": 0.0}}
    keyed_json(
        port, "/api/v1/retrieve_future", {"request_id": keyed_json(port, "/api/v1/optim_step", step)[1]["request_id"]}
    )
    while not stop.is_set():
        for body, want in (
            ({**step}, 409),
            ({**step, "seq_id": "x"}, 400),
            ({**step, "model_id": f"session-{random.randbytes(9).hex()}:train:0", "seq_id": 1}, 404),
        ):
            status, _ = keyed_json(port, "/api/v1/optim_step", body)
            out["seq_games"]["refused" if status == want else "accepted"] += 1
        time.sleep(0.05)


def slow(port: int, stop: threading.Event, out: dict) -> None:
    conns: list[socket.socket] = []
    while not stop.is_set():
        conns = [c for c in conns if c.fileno() != -1]
        while len(conns) < 32:
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(b"POST /api/v1/forward_bac")
            conns.append(c)
            out["slow"]["opened"] += 1
        for c in list(conns):
            c.setblocking(False)
            try:
                c.recv(4096)  # an answer (the 408) or the close: the server let it go
                out["slow"]["dropped by the server"] += 1
                c.close()
            except BlockingIOError:
                pass  # still held open, waiting for the rest of its request line
            except OSError:
                c.close()
        stop.wait(0.5)
    for c in conns:
        c.close()


def keyless(port: int, stop: threading.Event, out: dict) -> None:
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(
                    b"POST /api/v1/forward_backward HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                    b"Content-Length: 67108864\r\n\r\n"
                )
                try:
                    for _ in range(64):
                        s.sendall(bytes(1 << 20))
                except OSError:
                    pass  # the server closed the connection after its 401
                reply = s.recv(4096)
                out["keyless"]["refused" if reply.startswith(b"HTTP/1.1 401") else "accepted"] += 1
        except OSError:
            out["keyless"]["refused"] += 1


def monitor(port: int, pid: int, stop: threading.Event, out: dict) -> None:
    while not stop.is_set():
        try:
            status, _ = http(port, "GET", "/api/v1/healthz", timeout=10)
        except OSError:
            status = 0
        out["healthz"][str(status)] = out["healthz"].get(str(status), 0) + 1
        out["peak_rss_mib"] = max(out["peak_rss_mib"], rss_mib(pid))
        stop.wait(0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def honest_phase(sc, args, tokenizer, port: int, seed: int) -> tuple[dict, list[float], float]:
    """The honest SDK clients and the operator's completions, all at once: their counts, the
    operator's latencies and the seconds it took."""
    honest = {f"trainer {i}": {"ok": 0, "failed": 0, "errors": []} for i in range(args.clients)}
    honest |= {f"sampler {i}": {"ok": 0, "failed": 0, "errors": []} for i in range(args.samplers)}
    honest["operator"], latencies = {"ok": 0, "failed": 0, "errors": []}, []
    threads = [
        threading.Thread(
            target=trainer if name.startswith("trainer") else sampler,
            args=(sc, args.model, tokenizer, args.steps, seed + i, counts),
        )
        for i, (name, counts) in enumerate(honest.items())
        if name != "operator"
    ]
    threads.append(
        threading.Thread(target=operator, args=(port, OPERATOR, args.operator_requests, latencies, honest["operator"]))
    )
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return honest, latencies, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    import tinker

    from trillora.checkpoint import load_tokenizer, resolve_model_path
    from trillora.serve.http import owner_of
    from trillora.traces import TraceStore

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--samplers", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--operator-requests", type=int, default=200, help="the operator's completions per phase")
    p.add_argument("--model", default="tiny-moe-chat")
    p.add_argument("--header-seconds", type=float, default=2.0, help="the server's limit for a request's headers")
    p.add_argument("--max-connections", type=int, default=128, help="the server's connection slots")
    p.add_argument("--max-trace-mib", type=float, default=8.0, help="each key's trace store budget")
    p.add_argument("--max-state-gib", type=float, default=0.25, help="the saved states' and run records' quota")
    p.add_argument("--out", default=str(RESULTS / "tinker_under_attack.json"))
    args = p.parse_args(argv)
    port, state = free_port(), Path(tempfile.mkdtemp(prefix="tinker-attack-"))
    store, learn = state.parent / f"{state.name}-traces.db", state.parent / f"{state.name}-learn.toml"
    learn.write_text(LEARN)
    keys = [a for k in (OPERATOR, KEY, GUEST) for a in ("--api-key", k)]
    server = subprocess.Popen(
        [sys.executable, "-m", "trillora", "serve", args.model, "--tinker", *keys, "--port", str(port)]
        + ["--state-dir", str(state), "--record", str(store), "--learn", str(learn)]
        + ["--max-clients", str(3 * (3 * args.clients + 4)), "--max-connections", str(args.max_connections)]
        + ["--header-seconds", str(args.header_seconds), "--max-trace-mib", str(args.max_trace_mib)]
        + ["--max-state-gib", str(args.max_state_gib)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 180
        while True:
            try:
                if http(port, "GET", "/api/v1/healthz", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None or time.time() > deadline:
                raise SystemExit(f"the server did not start: {server.stderr.read().decode()[-2000:]}")
            time.sleep(0.5)
        tokenizer = load_tokenizer(resolve_model_path(args.model))
        sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=KEY)
        warm = {"ok": 0, "failed": 0, "errors": []}
        trainer(sc, args.model, tokenizer, 1, 0, warm)
        sampler(sc, args.model, tokenizer, 1, 0, warm)
        alone, alone_latencies, alone_seconds = honest_phase(sc, args, tokenizer, port, 100)
        baseline, state_before = rss_mib(server.pid), disk_bytes(state)
        out = {
            "model": args.model,
            "peak_rss_mib": baseline,
            "healthz": {},
            "shapes": {"refused": 0, "accepted": 0},
            "seq_games": {"refused": 0, "accepted": 0},
            "slow": {"opened": 0, "dropped by the server": 0},
            "keyless": {"refused": 0, "accepted": 0},
            "keyless_slots": {"opened": 0, "closed by the server": 0},
            "store_flood": defaultdict(int),
            "metadata_loop": {"made": 0, "refused": 0},
            "flood_full": threading.Event(),
        }
        stop = threading.Event()
        budgets = [  # phase 2: what a key makes the server keep, and keyless slots
            threading.Thread(target=keyless_slots, args=(port, 2 * args.max_connections, stop, out), daemon=True),
            threading.Thread(target=store_flood, args=(port, GUEST, stop, out), daemon=True),
            threading.Thread(target=metadata_loop, args=(port, GUEST, stop, out), daemon=True),
            threading.Thread(target=monitor, args=(port, server.pid, stop, out), daemon=True),
        ]
        for t in budgets:
            t.start()
        filling = time.perf_counter()
        if not out["flood_full"].wait(600) or "flood_error" in out:
            raise SystemExit(f"the guest's store flood was never refused: {out.get('flood_error', 'no trace budget')}")
        filling = time.perf_counter() - filling
        phases = {"alone": (alone, alone_latencies, alone_seconds)}
        phases["budget attacks"] = honest_phase(sc, args, tokenizer, port, 200)
        rest = [  # phase 3: every attack at once
            threading.Thread(target=f, args=(port, stop, out), daemon=True) for f in (shapes, seq_games, slow, keyless)
        ]
        for t in rest:
            t.start()
        time.sleep(1.0)  # under way before the honest clients start
        phases["every attack"] = honest_phase(sc, args, tokenizer, port, 300)
        time.sleep(2 * args.header_seconds)  # the slow connections' deadline passes at least once more
        stop.set()
        for t in budgets + rest:
            t.join(60)
        final = http(port, "GET", "/api/v1/healthz")[0]
    finally:
        server.terminate()
        server.wait(30)
    scope = {"headers": [(b"authorization", f"Bearer {GUEST}".encode())]}
    kept = TraceStore(str(store)).usage(owner_of(scope))
    report = {
        "command": "python benchmarks/tinker_under_attack.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model,
        "clients": args.clients,
        "samplers": args.samplers,
        "steps": args.steps,
        "operator_requests": args.operator_requests,
        "honest_requests": {
            phase: {k: sum(c[k] for c in counts.values()) for k in ("ok", "failed")}
            for phase, (counts, _, _) in phases.items()
        },
        "errors": [e for counts, _, _ in phases.values() for c in counts.values() for e in c["errors"]][:10],
        "seconds": {phase: took for phase, (_, _, took) in phases.items()} | {"flood_filling_its_budget": filling},
        "operator_p99_seconds": {phase: p99(latencies) for phase, (_, latencies, _) in phases.items()},
        "attacks": {
            k: dict(out[k])
            for k in ("shapes", "seq_games", "slow", "keyless", "keyless_slots", "store_flood", "metadata_loop")
        },
        "disk": {
            "guest_trace_bytes": kept[1],
            "guest_trace_calls": kept[0],
            "trace_budget_bytes": int(args.max_trace_mib * 2**20),
            "trace_store_bytes": disk_bytes(store),
            "state_bytes_growth": disk_bytes(state) - state_before,
            "state_quota_bytes": int(args.max_state_gib * 2**30),
        },
        "healthz": out["healthz"],
        "healthz_at_the_end": final,
        "rss_mib": {"after_warm_up": baseline, "peak": out["peak_rss_mib"]},
        "memory_bound_mib": MEMORY_BOUND_MIB,
        "machine": machine(tinker),
    }
    lat, d = report["operator_p99_seconds"], report["disk"]
    report["operator_p99_ratio"] = {phase: lat[phase] / lat["alone"] for phase in phases if phase != "alone"}
    report["within_bound"] = report["rss_mib"]["peak"] - baseline <= MEMORY_BOUND_MIB
    one_flood = d["guest_trace_bytes"] / max(1, report["attacks"]["store_flood"]["served"])
    report["disk_within_budgets"] = (
        d["guest_trace_bytes"] < d["trace_budget_bytes"] + one_flood
        and d["state_bytes_growth"] < d["state_quota_bytes"]
    )
    table = Table(
        title=f"serve --tinker ({args.model}) under attack: {args.clients} trainers + {args.samplers} samplers, "
        f"{args.steps} steps each, and {args.operator_requests} operator completions: alone, under the budget attacks, "
        "under every attack"
    )
    for col in ("what", "result"):
        table.add_column(col)
    ratio = report["operator_p99_ratio"]
    for phase, counts in report["honest_requests"].items():
        table.add_row(
            f"honest requests, {phase}",
            f"{counts['ok']} ok, {counts['failed']} failed ({report['seconds'][phase]:.1f} s); operator p99 "
            f"{lat[phase]:.3f} s" + (f" ({ratio[phase]:.2f}× alone)" if phase in ratio else ""),
        )
    for kind, counts in report["attacks"].items():
        table.add_row(f"attack: {kind}", ", ".join(f"{v} {k}" for k, v in counts.items()))
    table.add_row(
        "guest's trace store",
        f"{d['guest_trace_bytes'] / 2**20:.1f} MiB kept, budget {args.max_trace_mib:g} MiB "
        f"(filled in {filling:.1f} s); the store file {d['trace_store_bytes'] / 2**20:.1f} MiB",
    )
    table.add_row("state folder growth", f"{d['state_bytes_growth'] / 2**10:.0f} KiB, quota {args.max_state_gib:g} GiB")
    table.add_row(
        "/api/v1/healthz", ", ".join(f"{v}× {k}" for k, v in out["healthz"].items()) + f"; at the end {final}"
    )
    table.add_row(
        "server RSS (MiB)",
        f"{baseline:.0f} after warm-up, peak {out['peak_rss_mib']:.0f} "
        f"(+{out['peak_rss_mib'] - baseline:.0f}; bound +{MEMORY_BOUND_MIB})",
    )
    Console().print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
