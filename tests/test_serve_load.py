"""`trillora serve` under load from this process on loopback: 64 concurrent keep-alive clients, about
two thousand completions with wrong keys and path-traversal loads mixed in; no valid request fails, every
bad one is refused, and the server's memory stays flat. Bounded in requests and in time."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import pytest
from engine_helpers import free_port, wait_for_health
from test_serve_openai import KEY

pytestmark = pytest.mark.slow  # thousands of requests

CLIENTS, ROUNDS = 64, 24  # 1,536 completions and 128 refused requests, then 256 more of each kind


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def client(port: int, index: int, rounds: int, deadline: float, out: dict) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    good = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    try:
        for i in range(rounds):
            if time.time() > deadline:
                out["late"] += 1
                return
            body = {
                "model": "tiny-moe",
                "prompt": [[1, 5 + index % 10, 6 + i % 10]],
                "max_tokens": 2,
                "temperature": 1.0,
                "seed": index * 1000 + i,
                "logprobs": 1,
            }
            conn.request("POST", "/v1/completions", json.dumps(body), good)
            r = conn.getresponse()
            data = json.loads(r.read())
            out["ok" if r.status == 200 and len(data["choices"][0]["logprobs"]["tokens"]) >= 1 else "failed"] += 1
            if i == rounds // 2:  # a wrong key and a traversal attempt from every client, mid-run
                conn.request("POST", "/v1/completions", json.dumps(body), {**good, "Authorization": "Bearer nope"})
                r = conn.getresponse()
                r.read()
                out["wrong_key_refused"] += r.status == 401
                conn.request(
                    "POST",
                    "/v1/load_lora_adapter",
                    json.dumps({"lora_name": "x", "lora_path": "../../../../etc"}),
                    good,
                )
                r = conn.getresponse()
                r.read()
                out["traversal_refused"] += r.status == 403
    except Exception as e:  # a dropped connection or a timeout is a failed request
        out["failed"] += 1
        out["errors"].append(repr(e))
    finally:
        conn.close()


def run_clients(port: int, rounds: int, deadline: float) -> dict:
    counts = [
        {"ok": 0, "failed": 0, "late": 0, "wrong_key_refused": 0, "traversal_refused": 0, "errors": []}
        for _ in range(CLIENTS)
    ]  # one dict per client thread: nothing shared while they run
    threads = [threading.Thread(target=client, args=(port, i, rounds, deadline, counts[i])) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, deadline - time.time() + 60))
    return {
        k: (sum if k != "errors" else lambda lists: [e for x in lists for e in x])([c[k] for c in counts])
        for k in counts[0]
    }


def test_serve_under_64_concurrent_clients(tmp_path):
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trillora",
            "serve",
            "tiny-moe",
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--adapter-root",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        failure = wait_for_health(proc, f"http://127.0.0.1:{port}", 120)
        assert failure is None, failure
        start = time.time()
        deadline = start + 420
        warm = run_clients(port, 4, deadline)  # every client once, so the server has seen the whole load shape
        before = rss_kib(proc.pid)
        first = run_clients(port, ROUNDS // 2, deadline)
        middle = rss_kib(proc.pid)
        second = run_clients(port, ROUNDS // 2, deadline)
        after = rss_kib(proc.pid)
        print(
            f"{CLIENTS} clients, {CLIENTS * (4 + ROUNDS)} completions + {6 * CLIENTS} refused in "
            f"{time.time() - start:.1f} s; "
            f"server RSS {before} -> {middle} -> {after} KiB"
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    total = {k: warm[k] + first[k] + second[k] for k in ("ok", "failed", "late")}
    assert total == {"ok": CLIENTS * (4 + ROUNDS), "failed": 0, "late": 0}, (
        warm["errors"] + first["errors"] + second["errors"]
    )
    for part in (warm, first, second):
        assert part["wrong_key_refused"] == part["traversal_refused"] == CLIENTS
    # flat: the second half of the load grows the server no more than a small allowance over the first
    assert after - middle <= max(0.05 * before, 16 * 1024), (before, middle, after)
