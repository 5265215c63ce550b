"""`serve --tinker` under attack: honest SDK clients keep working while hostile ones hammer the server.

    python benchmarks/tinker_under_attack.py [--clients 8] [--samplers 8] [--steps 6] [--model tiny-moe-chat]

One `trillora serve MODEL --tinker --api-key ...` in a subprocess on loopback. Honest: `--clients`
training clients (the real `tinker` SDK: forward_backward + optim_step per step) and `--samplers`
sampling clients (n = 2 samples per step), all at once. Hostile, all the while:
- shapes: forward_backward bodies of 3 tokens whose `weights` declare [3, 50,000,000] values and send none;
- seq_id games: a replayed seq_id, a string seq_id, and calls on model ids of sessions never made;
- slow: 32 connections that send half a request line and nothing more, reopened once the server closes them;
- keyless: bodies announced at 64 MiB without the key, sent 1 MiB at a time.
Reported: every honest request answered or not, each kind of attack refused or not, the server's
resident memory (after warm-up, peak, at the end) and what `/api/v1/healthz` said each time it was
asked. Writes benchmarks/results/tinker_under_attack.json.
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
from pathlib import Path

from rich.console import Console
from rich.table import Table

os.environ.setdefault("TINKER_TELEMETRY", "0")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
KEY = "tml-attack"
MEMORY_BOUND_MIB = 256
"""The stated bound: the server's peak resident memory over its own after warm-up."""


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def http(
    port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None, timeout: float = 30.0
) -> tuple[int, bytes]:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode() + body)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
            top, _, rest = reply.partition(b"\r\n\r\n")
            length = [int(h.split(b":")[1]) for h in top.split(b"\r\n") if h.lower().startswith(b"content-length:")]
            if length and len(rest) >= length[0]:
                break
    top, _, rest = reply.partition(b"\r\n\r\n")
    return int(top.split(b" ")[1]), rest


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


def main(argv: list[str] | None = None) -> dict:
    import tinker

    from trillora.checkpoint import load_tokenizer, resolve_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--samplers", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--model", default="tiny-moe-chat")
    p.add_argument("--header-seconds", type=float, default=2.0, help="the server's limit for a request's headers")
    p.add_argument("--out", default=str(RESULTS / "tinker_under_attack.json"))
    args = p.parse_args(argv)
    port, state = free_port(), tempfile.mkdtemp(prefix="tinker-attack-")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trillora",
            "serve",
            args.model,
            "--tinker",
            "--api-key",
            KEY,
            "--port",
            str(port),
            "--state-dir",
            state,
            "--max-clients",
            str(args.clients + 4),
            "--header-seconds",
            str(args.header_seconds),
        ],
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
        baseline = rss_mib(server.pid)
        out = {
            "model": args.model,
            "peak_rss_mib": baseline,
            "healthz": {},
            "shapes": {"refused": 0, "accepted": 0},
            "seq_games": {"refused": 0, "accepted": 0},
            "slow": {"opened": 0, "dropped by the server": 0},
            "keyless": {"refused": 0, "accepted": 0},
        }
        stop = threading.Event()
        hostile = [
            threading.Thread(target=f, args=(port, stop, out), daemon=True) for f in (shapes, seq_games, slow, keyless)
        ]
        hostile.append(threading.Thread(target=monitor, args=(port, server.pid, stop, out), daemon=True))
        for t in hostile:
            t.start()
        time.sleep(1.0)  # the attacks under way before the honest clients start
        honest = {f"trainer {i}": {"ok": 0, "failed": 0, "errors": []} for i in range(args.clients)}
        honest |= {f"sampler {i}": {"ok": 0, "failed": 0, "errors": []} for i in range(args.samplers)}
        threads = [
            threading.Thread(
                target=trainer if name.startswith("trainer") else sampler,
                args=(sc, args.model, tokenizer, args.steps, i + 1, counts),
            )
            for i, (name, counts) in enumerate(honest.items())
        ]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        time.sleep(2 * args.header_seconds)  # the slow connections' deadline passes at least once more
        stop.set()
        for t in hostile:
            t.join(60)
        final = http(port, "GET", "/api/v1/healthz")[0]
    finally:
        server.terminate()
        server.wait(30)
    report = {
        "command": "python benchmarks/tinker_under_attack.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model,
        "clients": args.clients,
        "samplers": args.samplers,
        "steps": args.steps,
        "honest_requests": {
            "ok": sum(c["ok"] for c in honest.values()),
            "failed": sum(c["failed"] for c in honest.values()),
            "errors": [e for c in honest.values() for e in c["errors"]][:10],
        },
        "seconds": seconds,
        "attacks": {k: out[k] for k in ("shapes", "seq_games", "slow", "keyless")},
        "healthz": out["healthz"],
        "healthz_at_the_end": final,
        "rss_mib": {"after_warm_up": baseline, "peak": out["peak_rss_mib"]},
        "memory_bound_mib": MEMORY_BOUND_MIB,
    }
    report["within_bound"] = report["rss_mib"]["peak"] - baseline <= MEMORY_BOUND_MIB
    table = Table(
        title=f"serve --tinker ({args.model}) under attack: {args.clients} trainers + {args.samplers} samplers, "
        f"{args.steps} steps each"
    )
    for col in ("what", "result"):
        table.add_column(col)
    h = report["honest_requests"]
    table.add_row("honest requests answered", f"{h['ok']} ok, {h['failed']} failed ({seconds:.1f} s)")
    for kind, counts in report["attacks"].items():
        table.add_row(f"attack: {kind}", ", ".join(f"{v} {k}" for k, v in counts.items()))
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
