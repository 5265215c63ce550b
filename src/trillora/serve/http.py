"""The one HTTP layer of every face (`trillora serve`, `--tinker`): FastAPI routes behind a guard, on uvicorn.

What holds before any route runs, so that a client without the key, or a slow one, cannot hold
the server:

- a connection has `idle_seconds` to start a request and, from its first byte, `header_seconds`
  to finish the request's headers (uvicorn's own keep-alive timer restarts on every byte, so a
  client trickling bytes would hold its connection forever); a late one gets a JSON 408. Until
  one of its requests has passed the key check, a connection waits at most `header_seconds`;
- at most `max_connections` connections at once. When all are taken, a new one takes the slot of
  the oldest connection that has not passed the key check, from the peer address holding the most
  of those (a flood without the key loses its own connections first, and never locks out a client
  with one); else, with several keys, the oldest idle one of a key holding more than its even
  share; only when there is neither does the new one get a JSON 503. The open paths take no body;
- the API key (`Authorization: Bearer KEY` or `X-API-Key: KEY`, compared in constant time) is
  checked before the body is read: an unauthorised body is never buffered;
- a body over its limit, declared or chunked, is refused with 413 (read and dropped first when it
  is within DRAIN times the limit, else not read), and a body must arrive within `body_seconds` (408);
- every refusal and failure is a JSON body: `{"error": {"message": ...}}` on the OpenAI routes,
  `{"error": ..., "detail": ...}` on the Tinker ones (what each SDK reads).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import ipaddress
import json
import socket
import threading
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .calls import BadRequest

DRAIN = 16
"""A body over the limit by at most this factor is read and dropped before the 413 (clients that
send a whole body before reading the answer would otherwise see a reset); a larger one is not read."""
MAX_MESSAGE = 1000
OPEN_PATHS = frozenset({"/health", "/api/v1/healthz"})
"""Answered without the key: a load balancer's health checks."""


@dataclass(frozen=True)
class Limits:
    api_keys: tuple[str, ...]
    """Any of them opens every route (none: no key needed); each key's traffic is its own (`owner_of`)."""
    max_body_bytes: int
    """The OpenAI routes' bodies."""
    max_tinker_body_bytes: int
    """The Tinker routes' bodies (a forward_backward of long datums)."""
    max_connections: int = 512
    idle_seconds: float = 60.0
    header_seconds: float = 10.0
    body_seconds: float = 60.0


def key_of(headers: dict[bytes, bytes]) -> bytes:
    """The API key a request carries (`Authorization: Bearer KEY` or `X-API-Key: KEY`), or b""."""
    bearer = headers.get(b"authorization", b"")
    return bearer[7:] if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")


def owner_of(scope: dict) -> str:
    """Whose traffic a request is: a digest of its key (the key itself is never stored), "" without one."""
    key = key_of(dict(scope["headers"]))
    return hashlib.sha256(key).hexdigest()[:16] if key else ""


def check_operator(scope: dict, operator: str | None, what: str) -> None:
    """403 unless the request carries the operator's key (`ServeConfig.operator`; None: any key may)."""
    if operator is not None and owner_of(scope) != operator:
        raise BadRequest(f"{what} needs the operator's key (the first --api-key)", 403)


def peer_group(address: str) -> str:
    """The peer a connection counts against: its IPv4 address, or its IPv6 /64 (one host holds a
    whole /64 and can take a new address from it for every connection)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address  # a Unix socket's path
    if ip.version == 4:
        return str(ip)
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network(f"{ip}/64", strict=False))


def error_body(path: str, status: int, message: str) -> bytes:
    if len(message) > MAX_MESSAGE:  # messages quote what was sent: a long field must not come back many times over
        message = message[:MAX_MESSAGE] + f"... ({len(message)} characters)"
    # the Tinker SDK (/api/): a JSON body always (an empty 400 looks like a proxy's and is retried)
    if path.startswith("/api/"):
        return json.dumps({"error": message, "detail": message}).encode()
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


def json_object(raw: bytes) -> dict:
    """A request body as a JSON object, or BadRequest saying what is wrong with it."""
    try:
        body = json.loads(raw or b"{}")
    except json.JSONDecodeError as e:
        raise BadRequest(f"invalid JSON: {e.msg} at character {e.pos}") from None
    except RecursionError:
        raise BadRequest("invalid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


async def reply(send, path: str, status: int, message: str, close: bool = False) -> None:
    body = error_body(path, status, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:  # the rest of the request was not read: it must not be taken for the next request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware: the key before the body, the body whole and bounded before the app sees it."""

    def __init__(self, app, limits: Limits, keyed: dict | None = None):
        self.app, self.limits = app, limits
        self.keys = [k.encode() for k in limits.api_keys]
        self.keyed = keyed if keyed is not None else {}
        """Connections (peer (host, port)) whose requests have passed the key check: whose key (`owner_of`)."""

    def _authorised(self, headers: dict[bytes, bytes]) -> bool:
        if not self.keys:
            return True
        given = key_of(headers)
        return sum(hmac.compare_digest(given, k) for k in self.keys) > 0  # every key compared: no early exit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = scope["path"], dict(scope["headers"])
        if path in OPEN_PATHS:  # answered to anyone: nothing to read (a body would hold the connection)
            if int(headers.get(b"content-length", 0)) or b"chunked" in headers.get(b"transfer-encoding", b""):
                return await reply(send, path, 400, f"{path} takes no request body", close=True)
        elif not self._authorised(headers):
            denied = "missing or wrong API key (Authorization: Bearer KEY or X-API-Key: KEY)"
            return await reply(send, path, 401, denied, close=True)
        elif scope.get("client") is not None:
            self.keyed[scope["client"]] = owner_of(scope)
        limit = self.limits.max_tinker_body_bytes if path.startswith("/api/") else self.limits.max_body_bytes
        declared = int(headers.get(b"content-length", 0))  # h11 has refused a length that is not a number
        if declared > limit:
            # read and dropped, so that a client sending it all reads the 413 (one that waits for 100-continue is
            # not sent it)
            drained = declared <= DRAIN * limit and headers.get(b"expect", b"").lower() != b"100-continue"
            if drained and await self._read_body(receive, send, path, declared, keep=False) is None:
                return  # answered already: the body stalled (408) or the client left
            return await reply(
                send, path, 413, f"request body of {declared} bytes; this server takes at most {limit}", close=True
            )
        body = await self._read_body(receive, send, path, limit)
        if body is None:
            return
        started = False

        async def replay():
            nonlocal body
            if body is not None:
                message, body = {"type": "http.request", "body": body, "more_body": False}, None
                return message
            return await receive()  # after the body: only a disconnect comes

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, replay, tracked)
        except Exception as e:  # noqa: BLE001 - the client gets an answer, never a dropped connection
            if started:
                raise
            await reply(send, path, 500, f"{type(e).__name__}: {e}")

    async def _read_body(self, receive, send, path: str, limit: int, keep: bool = True) -> bytes | None:
        """The whole body, or None after answering 408 / 413 (or when the client left). A chunked
        body over the limit is drained up to DRAIN times the limit before the 413. `keep` False:
        read and drop (a body already refused)."""
        loop = asyncio.get_running_loop()
        deadline, parts, size, more = loop.time() + self.limits.body_seconds, [], 0, True
        while more and size <= DRAIN * limit:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                if size > limit:  # draining what is over the limit anyway
                    break
                late = f"the request body did not arrive within {self.limits.body_seconds:g} s"
                await reply(send, path, 408, late, close=True)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if keep and size <= limit:
                parts.append(chunk)
            more = message.get("more_body", False)
        if size > limit:
            await reply(
                send, path, 413, f"request body over {limit} bytes; this server takes at most {limit}", close=True
            )
            return None
        return b"".join(parts)


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on every wait for a request (`Limits`), a cap on
    connections, and JSON for the requests h11 refuses (a bad Content-Length, a malformed line)."""

    limits: Limits
    keyed: dict
    """Shared with the guard: the connections (peer (host, port)) that have passed the key check, and whose key."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.timer, self.waiting, self.refusal, self.half_closed = None, "idle", "malformed HTTP request", False
        self.write_timer = None
        next_event = self.conn.next_event

        def recording_next_event():  # uvicorn answers h11's refusals with a fixed text; keep h11's reason
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self.refusal = f"malformed HTTP request: {e}"
                raise

        self.conn.next_event = recording_next_event
        self.opened = self.loop.time()
        if len(self.connections) > self.limits.max_connections and not self._evict():
            return self._refuse(503, f"the server holds {self.limits.max_connections} connections at once; try again")
        self._arm("idle", self._idle_seconds)

    @property
    def _idle_seconds(self) -> float:
        """The wait for a request: shorter until one has passed the key check."""
        return (
            self.limits.idle_seconds
            if self.client in self.keyed
            else min(self.limits.idle_seconds, self.limits.header_seconds)
        )

    def _evict(self) -> bool:
        """Free a slot: the oldest connection that has not passed the key check, from the peer address
        holding the most of them; else, with several keys, the oldest idle one of the key holding the
        most, if that is over its even share. False when there is neither."""
        others = [c for c in self.connections if c is not self]
        unkeyed = [c for c in others if c.client not in self.keyed]
        if unkeyed:  # whatever it is doing: only the open paths and refusals run without the key
            host = lambda c: peer_group(c.client[0]) if c.client else None  # noqa: E731
            hosts = collections.Counter(map(host, unkeyed))
            crowded = max(hosts, key=hosts.get)
            victim = min((c for c in unkeyed if host(c) == crowded), key=lambda c: c.opened)
        else:
            keys, owners = len(self.limits.api_keys), collections.Counter(self.keyed[c.client] for c in others)
            owner, held = max(owners.items(), key=lambda x: x[1])
            idle = [c for c in others if self.keyed[c.client] == owner and c.waiting == "idle"]
            if keys < 2 or held <= self.limits.max_connections // keys or not idle:
                return False
            victim = min(idle, key=lambda c: c.opened)
        if victim.waiting == "headers":
            victim._refuse(503, "this connection's slot was taken by a newer one; it had not passed the key check")
        elif victim.waiting == "request":
            victim.transport.abort()
        else:
            victim.transport.close()
        self.connections.discard(victim)
        return True

    def _arm(self, waiting: str, seconds: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.waiting, self.timer = waiting, self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer, self.waiting = None, "request"

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if self.waiting == "idle" and self._between_requests():  # a request's first bytes: its headers are due
            self._arm("headers", self.limits.header_seconds)
        super().data_received(data)
        if not self._between_requests():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # a complete request already buffered starts now
        if self.half_closed and self._between_requests() and not self.conn.trailing_data[0]:
            self.transport.close()  # the client sends nothing more: its last answer is written
        elif not self.transport.is_closing() and self._between_requests():
            pipelined = bool(self.conn.trailing_data[0])  # part of the next request already arrived
            self._arm(
                "headers" if pipelined else "idle", self.limits.header_seconds if pipelined else self._idle_seconds
            )

    def eof_received(self) -> bool:
        """A client that shut its sending side still gets the answer to a request it completed (uvicorn
        would close at once); an incomplete one runs into the header deadline."""
        self.half_closed = True
        if self._between_requests() and not self.conn.trailing_data[0]:
            self.transport.close()
        return True

    def connection_lost(self, exc) -> None:
        for timer in (self.timer, self.write_timer):
            if timer is not None:
                timer.cancel()
        self.keyed.pop(self.client, None)
        super().connection_lost(exc)

    def _expired(self) -> None:
        if self.transport.get_write_buffer_size():  # a client that does not read its answers: close() would wait on it
            return self.transport.abort()
        if self.transport.is_closing():
            return
        if self.waiting == "headers":
            return self._refuse(408, f"the request's headers did not arrive within {self.limits.header_seconds:g} s")
        self.transport.close()  # idle between requests: a plain keep-alive close

    def timeout_keep_alive_handler(self) -> None:
        if self.transport.get_write_buffer_size():
            return self.transport.abort()
        super().timeout_keep_alive_handler()

    def pause_writing(self) -> None:
        """The client stopped reading: it has `idle_seconds` to read on before the connection is dropped."""
        super().pause_writing()
        self.write_timer = self.loop.call_later(self.limits.idle_seconds, self.transport.abort)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None

    def _refuse(self, status: int, message: str) -> None:
        body = json.dumps({"error": {"message": message, "code": status}, "detail": message}).encode()
        reason = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}[status]
        self.transport.write(
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: "
            f"{len(body)}\r\nconnection: close\r\n\r\n".encode()
            + body
        )
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, self.refusal)


class Listener:
    """uvicorn serving `app` behind the guard on (host, port); port 0 takes a free one (`port` then says which)."""

    def __init__(self, app, host: str, port: int, limits: Limits):
        keyed: dict = {}
        protocol = type("Protocol", (TimedH11Protocol,), {"limits": limits, "keyed": keyed})
        self.config = uvicorn.Config(
            Guard(app, limits, keyed),
            host=host,
            port=port,
            http=protocol,
            ws="none",
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=max(1, int(limits.idle_seconds)),
            timeout_graceful_shutdown=2,
            proxy_headers=False,  # a connection is its own peer: `keyed` and the per-address shares count it
            h11_max_incomplete_event_size=64 << 10,
        )
        self.server = uvicorn.Server(self.config)
        self.socket: socket.socket = self.config.bind_socket()
        self.socket.listen(2048)  # uvicorn listens only once it starts; connections made before then wait
        self.host, self.port = host, self.socket.getsockname()[1]

    def run(self, ready: threading.Event | None = None) -> None:
        """Serve until `stop()` (or Ctrl-C in the main thread); `ready` is set once connections are taken."""
        if ready is not None:
            ready.set()  # the socket listens already: a client that connects now waits in its backlog
        self.server.run(sockets=[self.socket])

    def stop(self) -> None:
        self.server.should_exit = True
