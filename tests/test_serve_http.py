"""The HTTP layer as an attacker meets it (`serve.http`), on loopback: slow and idle connections,
bodies without the key, bodies larger than they say, chunked bodies, too many connections. Each
refusal is a JSON body; a client with the key is still served."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_helpers import free_port, running_server, wait_for_health

from trillora.serve.config import ServeConfig

KEY = "test-key"


@pytest.fixture(scope="module")
def server():
    """tiny-moe's OpenAI routes with the Tinker ones, short body and header limits for the tests."""
    yield from running_server(
        ServeConfig(
            model="tiny-moe",
            tinker=True,
            port=0,
            api_key=KEY,
            header_seconds=60,
            idle_seconds=60,
            body_seconds=2,
            max_connections=100,
            max_body_bytes=1 << 16,
        )
    )


def request(port: int, raw: bytes, timeout: float = 30.0) -> bytes:
    """Send `raw`, then read until the server closes (or answers one response with a length)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(raw)
        return read_reply(sock)


def read_reply(sock: socket.socket) -> bytes:
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        length = [int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")]
        if length and len(body) >= length[0]:
            break
    return reply


def status_and_json(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def models(port: int, timeout: float = 20.0) -> tuple[int, dict]:
    return status_and_json(
        request(port, f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode(), timeout)
    )


def test_64_half_requests_without_the_key_do_not_hold_the_server(server):
    """Each sends half a request line and waits (their header deadline is 60 s here); a thread per
    connection with 64 slots would make the client with the key wait for those 60 s."""
    port = server.cfg.port
    slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
    try:
        for s in slow:
            s.sendall(b"POST /v1/compl")
        started = time.monotonic()
        status, out = models(port)
        took = time.monotonic() - started
        assert status == 200 and out["data"][0]["id"] == "tiny-moe"
        print(f"the client with the key answered in {took * 1000:.0f} ms beside 64 half requests")
        for s in slow:  # and the slow ones are still open: nothing was freed to make room
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        for s in slow:
            s.close()


def test_a_request_whose_headers_stall_gets_408_and_is_closed():
    gen = running_server(ServeConfig(model="tiny-moe", port=0, api_key=KEY, header_seconds=0.5, idle_seconds=0.5))
    srv = next(gen)
    try:
        status, out = status_and_json(request(srv.cfg.port, b"GET /v1/mod"))
        assert status == 408 and "headers did not arrive within 0.5 s" in out["error"]["message"]
        with socket.create_connection(("127.0.0.1", srv.cfg.port), timeout=30) as idle:  # idle: closed, no answer
            assert idle.recv(1) == b""
        # a trickle of bytes does not keep a connection: the deadline runs from the first byte
        with socket.create_connection(("127.0.0.1", srv.cfg.port), timeout=30) as sock:
            reply = b""
            for c in b"GET /v1/models HTTP/1.1\r\nHost: x\r\n":
                try:
                    sock.sendall(bytes([c]))
                except OSError:
                    break
                time.sleep(0.05)
            reply = read_reply(sock)
        assert status_and_json(reply)[0] == 408
    finally:
        next(gen, None)


def test_a_body_that_stalls_gets_408(server):
    reply = request(
        server.cfg.port,
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"prompt"'.encode(),
    )
    status, out = status_and_json(reply)
    assert status == 408 and "did not arrive within 2 s" in out["error"]["message"]


def test_bodies_over_the_limit_are_refused_declared_or_chunked(server):
    port = server.cfg.port
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
    )
    status, out = status_and_json(request(port, (head + f"Content-Length: {1 << 30}\r\n\r\n").encode()))
    assert status == 413 and "at most 65536" in out["error"]["message"]
    chunk = b"x" * 50_000
    chunked = (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + b"".join(
        b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3)
    )
    status, out = status_and_json(request(port, chunked))
    assert status == 413 and "over 65536 bytes" in out["error"]["message"]
    # a chunked body within the limit is read whole
    body = json.dumps({"prompt": "rev abc=", "max_tokens": 5, "temperature": 0}).encode()
    parts = [body[:7], body[7:]]
    ok = (
        (head + "Transfer-Encoding: chunked\r\n\r\n").encode()
        + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
        + b"0\r\n\r\n"
    )
    status, out = status_and_json(request(port, ok))
    assert status == 200 and out["choices"][0]["text"] == "cba"
    # the Tinker routes take the same key, by either header, and answer in their SDK's shape
    status, out = status_and_json(
        request(port, b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    )
    assert status == 401 and "API key" in out["error"]
    status, out = status_and_json(
        request(
            port,
            f"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY}\r\n"
            f"Content-Length: 2\r\n\r\n{{}}".encode(),
        )
    )
    assert status == 200 and out["session_id"].startswith("session-")


@pytest.mark.parametrize("length", ["-1", "x", "1, 2"])
def test_a_malformed_content_length_gets_a_json_400(server, length):
    reply = request(
        server.cfg.port,
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Length: {length}\r\n\r\n{{}}".encode(),
    )
    status, out = status_and_json(reply)
    assert status == 400 and "Content-Length" in out["error"]["message"], out
    assert models(server.cfg.port)[0] == 200  # and it serves on


def _closed(sock: socket.socket, wait: float) -> bool:
    """The server closed `sock` (or reset it) within `wait` seconds."""
    sock.settimeout(wait)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_connections_without_the_key_give_way_and_keyed_ones_past_the_cap_get_503():
    """A client without any key held every slot (--max-connections idle sockets, reconnecting at
    once) and /health and the operator got 503 for as long as it lasted. Now a connection that has
    not passed the key check waits at most `header_seconds` and gives its slot to a newer one; only
    connections that passed it can fill the server."""
    gen = running_server(
        ServeConfig(model="tiny-moe", port=0, api_key=KEY, max_connections=3, header_seconds=1, idle_seconds=60)
    )
    port = next(gen).cfg.port
    keyed = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    held, flood = [], []
    try:
        flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]  # no key, never a request
        time.sleep(0.3)
        assert request(port, health).startswith(b"HTTP/1.1 200")
        for _ in range(3):  # clients with the key, kept alive: each takes a keyless one's slot
            held.append(socket.create_connection(("127.0.0.1", port)))
            held[-1].sendall(keyed)
            assert read_reply(held[-1]).startswith(b"HTTP/1.1 200")
        assert sum(_closed(s, 0.5) for s in flood) == len(flood)  # the flood lost every slot it held
        status, out = status_and_json(request(port, health))  # every slot holds a client with the key
        assert status == 503 and "3 connections at once" in out["error"]["message"]
        time.sleep(1.5)  # past header_seconds: a keyed connection waits up to idle_seconds
        held[0].sendall(keyed)
        assert read_reply(held[0]).startswith(b"HTTP/1.1 200")
        held.pop().close()
        for _ in range(100):  # the server sees the close shortly
            reply = request(port, health)
            if reply.startswith(b"HTTP/1.1 200"):
                break
            time.sleep(0.1)
        assert reply.startswith(b"HTTP/1.1 200")
        idle = socket.create_connection(("127.0.0.1", port))  # without the key: header_seconds to start
        assert _closed(idle, 10)
        status, out = status_and_json(request(port, b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n"))
        assert status == 400 and "takes no request body" in out["error"]["message"]  # it would hold its slot
    finally:
        for s in held + flood:
            s.close()
        next(gen, None)


def test_an_ipv6_peer_counts_as_its_64():
    """The eviction's per-address count: an IPv6 host takes any address of its /64 for each connection,
    so the /64 is the peer; an IPv4 address mapped into IPv6 is that IPv4 address."""
    from trillora.serve.http import peer_group

    a, b = peer_group("2001:db8:1:2:aaaa::1"), peer_group("2001:db8:1:2:bbbb:cccc:dddd:eeee")
    assert a == b == "2001:db8:1:2::/64" and peer_group("2001:db8:1:3::1") != a
    assert peer_group("::ffff:10.0.0.7") == peer_group("10.0.0.7") == "10.0.0.7" and peer_group("/run/s.sock")


def test_a_key_holding_more_than_its_share_of_connections_gives_way_to_another():
    """With several keys, a guest that keeps every slot alive with a request each still leaves room
    for the operator: its oldest idle connection goes once it holds more than its even share."""
    gen = running_server(ServeConfig(model="tiny-moe", port=0, api_key=["op", "guest"], max_connections=4))
    port = next(gen).cfg.port
    asked = "GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\r\n"
    held = []
    try:
        for _ in range(4):
            held.append(socket.create_connection(("127.0.0.1", port)))
            held[-1].sendall(asked.format("guest").encode())
            assert read_reply(held[-1]).startswith(b"HTTP/1.1 200")
        assert request(port, asked.format("op").encode()).startswith(b"HTTP/1.1 200")
        assert _closed(held[0], 5) and not _closed(held[-1], 0.5)  # the guest's oldest gave way
    finally:
        for s in held:
            s.close()
        next(gen, None)


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """The process's resident memory now (VmRSS) or at its peak (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field}")


@pytest.mark.slow
def test_a_body_without_the_key_is_not_read():
    """A 1 GiB body announced without the key: 401 at once and the connection closed, so the
    client cannot push more than the sockets' buffers; the server's memory does not grow."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "trillora", "serve", "tiny-moe", "--port", str(port), "--api-key", KEY],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        failure = wait_for_health(proc, f"http://127.0.0.1:{port}", 120)
        assert failure is None, failure
        before = rss_kib(proc.pid)
        sent, reply = 0, b""
        for _ in range(4):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {1 << 30}\r\n\r\n".encode())
                block = b"x" * (1 << 20)
                try:
                    for _ in range(256):  # 256 MiB, if the server read it all
                        sock.sendall(block)
                        sent += len(block)
                except OSError:  # reset: the server closed after its 401
                    pass
                with contextlib.suppress(OSError):
                    reply = read_reply(sock) or reply
        after = rss_kib(proc.pid)
        print(f"sent {sent >> 20} MiB of 1 GiB over 4 connections; server RSS {before} -> {after} KiB")
        assert sent < 4 * 64 << 20  # the kernel's buffers, not the body
        assert after - before < 16 << 10, (before, after)
        assert not reply or status_and_json(reply)[0] == 401
        # with the key, a body over the 1 MiB limit (but within 16×) is read so the client sees the 413, and dropped
        body, peak = b"x" * (15 << 20), rss_kib(proc.pid, "VmHWM")
        for _ in range(3):
            status, out = status_and_json(
                request(
                    port,
                    f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    f"{KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                    + body,
                )
            )
            assert status == 413 and "at most 1048576" in out["error"]["message"]
        drained = rss_kib(proc.pid, "VmHWM")
        print(f"3 keyed 15 MiB bodies drained: server peak RSS {peak} -> {drained} KiB")
        assert drained - peak < 8 << 10, (peak, drained)  # read and dropped, never held whole
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def keyed(port: int, method: str, path: str, body: object = None, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode() if body is not None else b""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return status_and_json(request(port, head.encode() + data))


def test_a_half_closed_client_still_gets_its_answers(server):
    one = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.cfg.port), timeout=30) as sock:
        sock.sendall(one.encode())
        sock.shutdown(socket.SHUT_WR)
        status, out = status_and_json(read_reply(sock))
    assert status == 200 and out["data"][0]["id"] == "tiny-moe"
    with socket.create_connection(("127.0.0.1", server.cfg.port), timeout=30) as sock:  # three at once, then the close
        sock.sendall((one * 3).encode())
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.count(b"HTTP/1.1 200") == 3


def test_a_pipelined_partial_request_has_the_header_deadline():
    gen = running_server(ServeConfig(model="tiny-moe", port=0, api_key=KEY, header_seconds=0.5, idle_seconds=60))
    srv = next(gen)
    try:
        first = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n"
        with socket.create_connection(("127.0.0.1", srv.cfg.port), timeout=30) as sock:
            sock.sendall((first + "GET /v1/models HTTP/1.1\r\nHost: x\r\n").encode())
            reply = b""
            while chunk := sock.recv(65536):  # the first answer, then the second's 408, then the close
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in reply
    finally:
        next(gen, None)


def test_errors_do_not_echo_a_long_field_back(server):
    status, out = keyed(server.cfg.port, "POST", "/api/v1/retrieve_future", {"request_id": "x" * 50_000})
    assert status == 404 and len(json.dumps(out)) < 5000 and "characters)" in out["error"]


def test_the_openai_revisions_are_out_of_the_tinker_routes_reach(server):
    """The session holding the OpenAI routes' revisions (the base among them) is no Tinker session."""
    port = server.cfg.port
    for path, body in [
        (
            "/api/v1/create_sampling_session",
            {"session_id": "served", "sampling_session_seq_id": "evil", "base_model": "tiny-moe"},
        ),
        (
            "/api/v1/create_model",
            {"session_id": "served", "model_seq_id": 0, "base_model": "tiny-moe", "lora_config": {"rank": 1}},
        ),
        (
            "/api/v1/asample",
            {"sampling_session_id": "served:sample:tiny-moe", "prompt": {"chunks": [{"tokens": [5, 6]}]}},
        ),
    ]:
        status, out = keyed(port, "POST", path, body)
        assert status == 404 and "served" in out["error"], (path, out)
    assert keyed(port, "GET", "/api/v1/sessions/served")[0] == 404
    assert [m["id"] for m in models(port)[1]["data"]] == ["tiny-moe"]


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("top_k", "Infinity", "OverflowError|cannot convert float infinity"),
        ("temperature", "NaN", "temperature=nan"),
        ("temperature", "1e-320", "temperature="),
        ("seed", str(2**64), "seed must be in 0..2\\*\\*63-1"),
        ("seed", "Infinity", "seed must be an integer"),
        ("seed", '"x"', "seed must be an integer"),
    ],
)
def test_sampling_settings_out_of_range_get_400_on_both_faces(server, field, value, message):
    import re

    port = server.cfg.port
    raw = f'{{"prompt": "1+1=", "max_tokens": 2, "{field}": {value}}}'.encode()
    status, out = keyed(port, "POST", "/v1/completions", raw=raw)
    assert status == 400 and re.search(message, out["error"]["message"]), out
    session = keyed(port, "POST", "/api/v1/create_session", {})[1]["session_id"]
    raw = (
        f'{{"base_model": "tiny-moe", "prompt": {{"chunks": [{{"tokens": [5, 6]}}]}}, '
        f'"sampling_params": {{"max_tokens": 2, "{field}": {value}}}, "num_samples": 1}}'
    ).encode()
    status, out = keyed(port, "POST", "/api/v1/asample", raw=raw)
    assert session and status == 400 and "sampling_params" in out["error"], out


def test_counts_are_checked_before_anything_is_built(server):
    body = {"base_model": "tiny-moe", "prompt": {"chunks": [{"tokens": [1, 2]}]}, "num_samples": 10**9}
    status, out = keyed(server.cfg.port, "POST", "/api/v1/asample", body)
    assert status == 400 and "num_samples=1000000000" in out["error"]


def test_json_nested_too_deeply_is_a_400(server):
    deep = b"[" * 30_000 + b"]" * 30_000  # within the 64 KiB bound, past the parser's depth
    assert keyed(server.cfg.port, "POST", "/v1/completions", raw=deep)[0] == 400
    assert keyed(server.cfg.port, "POST", "/api/v1/create_session", raw=deep)[0] == 400


def test_adapter_paths_that_cannot_be_read_or_link_outside_are_refused(tmp_path):
    from trillora import lora
    from trillora.checkpoint import load_model, resolve_model_path

    root, outside = tmp_path / "root", tmp_path / "outside"
    model = load_model(resolve_model_path("tiny-moe"))
    lora.apply_lora(model, lora.LoraConfig(rank=2))
    lora.save_adapter(model, outside / "adp")
    (root / "links").mkdir(parents=True)
    for f in (outside / "adp").iterdir():  # a folder inside the root whose files lead out of it
        (root / "links" / f.name).symlink_to(f)
    (root / "loop").symlink_to(root / "loop")
    gen = running_server(ServeConfig(model="tiny-moe", port=0, api_key=KEY, adapter_root=str(root)))
    port = next(gen).cfg.port
    try:
        for given, want in [("links", 403), ("loop", 400), ("x" * 5000, 400)]:
            status, out = keyed(port, "POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": given})
            assert status == want and str(tmp_path) not in out["error"]["message"], (given, out)
    finally:
        next(gen, None)


def test_a_failing_group_of_samples_fails_alone():
    """Samples that wait together run as groups (one `generate` per samples-per-prompt n, each call
    with its own settings); one group's failure is its own calls' outcome, the others' results stand."""
    from trillora.serve.calls import SampleCall
    from trillora.serve.tinker.service import TinkerService

    service = TinkerService(ServeConfig(model="tiny-moe"))
    base = f"served:sample:{service.cfg.model}"
    real = service.engine.generate

    def failing_on_one_prompt(prompts, n, sp, **kw):  # a fault injected into one group's generate
        if [7, 7, 7] in prompts:
            raise RuntimeError("injected")
        return real(prompts, n, sp, **kw)

    service.engine.generate = failing_on_one_prompt
    calls = [
        SampleCall(base, [7, 7, 7], 1, {"max_tokens": 2}),
        SampleCall(base, [5, 6], 2, {"max_tokens": 3, "temperature": 0.0}),
    ]  # another n: another group
    failed, ok = service.sample_many(calls)
    assert isinstance(failed, RuntimeError) and str(failed) == "injected"
    assert len(ok[0]) == 2 and len(ok[0][0][0]) >= 1


def test_a_refused_numbered_request_keeps_its_clients_order_and_the_worker_alive(server):
    """A `seq_id` that is not an integer is refused at the edge (it used to kill the worker once queued);
    a refused request still takes its place in its client's order, so the next one is not held."""
    port = server.cfg.port
    sid = keyed(port, "POST", "/api/v1/create_session", {})[1]["session_id"]
    created = keyed(
        port,
        "POST",
        "/api/v1/create_model",
        {"session_id": sid, "model_seq_id": 0, "base_model": "tiny-moe", "lora_config": {"rank": 2}},
    )[1]
    assert (
        keyed(port, "POST", "/api/v1/retrieve_future", {"request_id": created["request_id"]})[1]["model_id"]
        == created["model_id"]
    )
    mid = created["model_id"]
    status, out = keyed(port, "POST", "/api/v1/optim_step", {"model_id": mid, "seq_id": "x", "adam_params": {}})
    assert status == 400 and "seq_id='x'" in out["error"]
    status, out = keyed(port, "POST", "/api/v1/optim_step", {"model_id": mid, "seq_id": 1})  # refused: no adam_params
    assert status == 400 and "needs adam_params" in out["error"]
    assert server.worker.next_seq[mid] == 2 and not server.worker.waiting[mid]  # seq 1 done: seq 2 runs at once
    assert server.worker.alive and keyed(port, "GET", "/api/v1/healthz")[1] == {"status": "ok"}
