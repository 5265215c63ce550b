"""The attacks on what a key makes the server keep, for `tinker_under_attack.py`: a guest key's trace
store flood and run-metadata loop, connections without a key holding slots, and the operator's
recorded completions timed all the while. Each runs until `stop` is set, counting into `out`."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

FLOOD = {  # the largest request one call may be: 64 prompts × n=64 × (1 + 15) tokens = the 65,536-token cap
    "prompt": [[5]] * 64,
    "n": 64,
    "max_tokens": 15,
    "stop_token_ids": [105] * 63,  # the settings the attacker sent: 63 stop ids (the tiny models' vocabulary is 106)
    "user": "u" * 256,
}


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
    if not reply:
        raise ConnectionError("closed without an answer")
    top, _, rest = reply.partition(b"\r\n\r\n")
    return int(top.split(b" ")[1]), rest


def post(port: int, path: str, body: dict, key: str, timeout: float = 120.0) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    status, raw = http(port, "POST", path, json.dumps(body).encode(), headers, timeout)
    return status, json.loads(raw)


def store_flood(port: int, key: str, stop: threading.Event, out: dict) -> None:
    """The guest's largest recorded completions, back to back: served until its budget is full, then 403."""
    counts = out["store_flood"]
    while not stop.is_set():
        status, answer = post(port, "/v1/completions", FLOOD, key, timeout=600)
        counts["served" if status == 200 else "refused" if status == 403 else str(status)] += 1
        if status not in (200, 403):
            out["flood_error"] = f"{status}: {str(answer)[:300]}"
        if status != 200:
            out["flood_full"].set()


def metadata_loop(port: int, key: str, stop: threading.Event, out: dict) -> None:
    """A new session and training client with the most run metadata allowed (16 KiB), again and again."""
    counts, blob = out["metadata_loop"], {"blob": "x" * 15000}
    while not stop.is_set():
        sid = post(port, "/api/v1/create_session", {}, key)[1].get("session_id")
        body = {"session_id": sid, "model_seq_id": 0, "base_model": out["model"], "lora_config": {"rank": 1}}
        status, made = post(port, "/api/v1/create_model", {**body, "user_metadata": blob}, key)
        if status == 200:
            status, made = post(port, "/api/v1/retrieve_future", made, key)
        counts["made" if status == 200 and "model_id" in made else "refused"] += 1
        stop.wait(0.05)


def keyless_slots(port: int, hold: int, stop: threading.Event, out: dict) -> None:
    """`hold` idle connections without a key (twice the server's slots), each reopened once it is closed,
    from an address of their own (127.0.0.2: the honest clients are at 127.0.0.1)."""
    counts, conns = out["keyless_slots"], []
    while not stop.is_set():
        alive = []
        for c in conns:
            c.setblocking(False)
            try:
                gone = c.recv(1) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                counts["closed by the server"] += 1
                c.close()
            else:
                alive.append(c)
        conns = alive
        while len(conns) < hold:
            try:
                conns.append(socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.2", 0)))
                counts["opened"] += 1
            except OSError:
                break
        stop.wait(0.2)
    for c in conns:
        c.close()


def operator(port: int, key: str, requests: int, latencies: list[float], out: dict) -> None:
    """The operator's product traffic: recorded 4-token completions, each rewarded, one after another."""
    for i in range(requests):
        start = time.perf_counter()
        try:
            status, made = post(port, "/v1/completions", {"prompt": f"{i}+1=", "max_tokens": 4}, key)
        except OSError as e:
            status, made = 0, {"error": str(e)}
        latencies.append(time.perf_counter() - start)
        if status == 200:
            status = post(port, "/v1/feedback", {"trace_id": made["trace_id"], "reward": 1.0}, key)[0]
        out["ok" if status == 200 else "failed"] += 1
        if status != 200:
            out["errors"].append(f"operator: {status} {str(made)[:200]}")
        time.sleep(0.02)


def p99(seconds: list[float]) -> float:
    ordered = sorted(seconds)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def disk_bytes(path: Path) -> int:
    """Disk a file (with its SQLite journal) or a folder takes."""
    if path.is_dir():
        return sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(path) for f in fs)
    return sum(os.lstat(p).st_blocks * 512 for p in (path, Path(f"{path}-wal")) if p.exists())
