"""`trillora serve MODEL --tinker`: the REST API the `tinker` SDK calls, on `TinkerService`.

Operations that compute (create_model, forward[_backward], optim_step, save / load, sample)
return a future id at once and run on ONE worker thread (`serve.worker`: each client's requests
in `seq_id` order; forward_backward calls and samples that wait together share one pass); the
SDK then polls `retrieve_future`, which holds the poll until the result is there (or
`poll_seconds` passed: `try_again`). Forward, forward_backward and
sample results go back as protobuf (`wire`), everything else as JSON.

Requests that cannot succeed (unknown model, rank 0, a datum whose lengths disagree, an
unknown loss, a body too large or not the message it claims) are refused when they arrive,
with a 4xx and a message; a failure found while running comes back as the future's error.
Safety as `trillora serve`: binds 127.0.0.1, `X-API-Key` checked when a key is set, bounded
bodies, counts and connections; saved states only under `state_dir`.
"""

from __future__ import annotations

import hmac
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler

from ..rollout.serve import drain, run_http
from . import wire
from .tinker_service import BadRequest, FwdBwd, SampleCall, TinkerConfig, TinkerService
from .worker import Job, Worker

PROTO = "application/x-protobuf"
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False, "parallel_fwdbwd_chunks": True,
                 "sample_use_retrieve_futures": False, "sample_join_sampling_session": False,
                 "custom_loss_server_side": False}


@dataclass
class Future:
    done: threading.Event = field(default_factory=threading.Event)
    body: bytes = b""
    proto: bool = False
    created: float = field(default_factory=time.monotonic)


class TinkerServer:
    def __init__(self, cfg: TinkerConfig, service: TinkerService | None = None):
        self.cfg = cfg
        self.service = service or TinkerService(cfg)
        self.worker = Worker({"forward_backward": self._fused_forward_backward, "sample": self._fused_sample},
                             max_fused=cfg.max_fused, gather_seconds=cfg.gather_seconds)
        self.futures: dict[str, Future] = {}
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.httpd = None  # the HTTP server once listening (`bound`)

    def bound(self, httpd) -> None:
        """The HTTP server is listening: its port (0 asked for any) and a handle to stop it."""
        self.httpd, self.cfg.port = httpd, httpd.server_address[1]

    # --- futures -------------------------------------------------------------------------
    def start(self, fn, proto: bool = False, model_id: str | None = None, seq_id: int | None = None,
              fuse: str | None = None, payload=None) -> dict:
        """Queue `fn` (returns a JSON dict, or protobuf bytes when `proto`); the future's id.
        `fuse`/`payload`: the kind of request and what its fuser needs, to share a pass."""
        with self.lock:
            rid = f"req-{next(self.ids)}"
            fut = self.futures[rid] = Future(proto=proto)
            old = [k for k, f in self.futures.items() if f.done.is_set() and time.monotonic() - f.created > 3600]
            for k in old:
                del self.futures[k]

        def settle(out) -> None:
            if isinstance(out, BadRequest):
                fut.body, fut.proto = json.dumps({"error": str(out), "category": "user"}).encode(), False
            elif isinstance(out, Exception):  # a server fault still answers the poll, with what went wrong
                fut.body, fut.proto = json.dumps({"error": f"{type(out).__name__}: {out}", "category": "server"}).encode(), False
            else:
                fut.body = out if proto else json.dumps(out).encode()
            fut.done.set()

        self.worker.submit(Job(fn, settle, model_id, fuse, payload), seq_id)
        return {"request_id": rid, **({"model_id": model_id} if model_id else {})}

    def now(self, fn):
        """`fn`'s result (or the error it raised), run on the worker between requests: calls that
        answer at once still change the model's state only there (a parallel service mirrors
        them to its other ranks in the worker's order)."""
        box, done = [], threading.Event()
        self.worker.submit(Job(fn, lambda out: (box.append(out), done.set())))
        done.wait()
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    def _fused_forward_backward(self, calls: list[FwdBwd]) -> list:
        outs = self.service.forward_backward_many(calls)
        return [o if isinstance(o, Exception) else wire.forward_backward_output({"logprobs": o[0]}, o[1], len(c.data))
                for c, o in zip(calls, outs)]

    def _fused_sample(self, calls: list[SampleCall]) -> list:
        return [o if isinstance(o, Exception) else wire.sample_response(*o) for o in self.service.sample_many(calls)]

    def retrieve(self, body: dict) -> tuple[bytes, str]:
        fut = self.futures.get(body.get("request_id", ""))
        if fut is None:
            raise BadRequest(f"unknown request_id {body.get('request_id')!r}", 404)
        if not fut.done.wait(self.cfg.poll_seconds):
            return json.dumps({"type": "try_again", "request_id": body["request_id"], "queue_state": "active"}).encode(), "application/json"
        return fut.body, PROTO if fut.proto else "application/json"

    # --- routes --------------------------------------------------------------------------
    def post(self, path: str, raw: bytes, content_type: str) -> tuple[bytes, str]:
        s = self.service
        if path == "/api/v1/forward_backward":
            if PROTO not in content_type:
                raise BadRequest(f"forward_backward takes {PROTO} bodies, not {content_type or 'none'}", 415)
            try:
                req = wire.read_forward_backward(raw)
            except wire.WireError as e:
                raise BadRequest(f"forward_backward body: {e}") from None
            s.client(req.model_id)
            tensors = s.check_data(req.loss_fn, req.loss_fn_config, req.data)  # refused now, not in the future

            call = FwdBwd(req.model_id, req.loss_fn, req.loss_fn_config, req.data, tensors, req.forward_only)
            return self._json(self.start(lambda: self._fused_forward_backward([call])[0], proto=True, model_id=req.model_id,
                                         seq_id=req.seq_id, fuse="forward_backward", payload=call))
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError as e:
            raise BadRequest(f"invalid JSON: {e.msg} at character {e.pos}") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if path == "/api/v1/retrieve_future":
            return self.retrieve(body)
        handler = self._routes().get(path)
        if handler is None and path.startswith("/api/v1/sessions/") and path.endswith("/finish"):
            return self._json({})
        if handler is None:
            raise BadRequest(f"no route POST {path}", 404)
        return self._json(handler(body))

    def _routes(self) -> dict:
        s = self.service
        return {
            "/api/v1/client/config": lambda b: CLIENT_CONFIG,
            "/api/v1/client/dynamic_config": lambda b: {"refresh_interval_sec": 300},
            "/api/v1/telemetry": lambda b: {"status": "accepted"},
            "/api/v1/create_session": lambda b: {"type": "create_session", "session_id": s.create_session()},
            "/api/v1/session_heartbeat": lambda b: (s.session(b.get("session_id", "")), {"type": "session_heartbeat"})[1],
            "/api/v1/create_model": self._create_model,
            "/api/v1/get_info": lambda b: s.info(b.get("model_id", "")),
            "/api/v1/optim_step": self._optim_step,
            "/api/v1/save_weights": self._save_weights,
            "/api/v1/save_weights_for_sampler": self._save_for_sampler,
            "/api/v1/load_weights": self._load_weights,
            "/api/v1/create_sampling_session": self._create_sampler,
            "/api/v1/asample": self._sample,
            "/api/v1/weights_info": self._weights_info,
        }

    def get(self, path: str) -> dict:
        s = self.service
        if path == "/api/v1/get_server_capabilities":
            return s.capabilities()
        if path.startswith("/api/v1/samplers/"):
            sid = path.rsplit("/", 1)[1]
            s.sampler(sid)
            return {"sampler_id": sid, "base_model": s.cfg.model}
        if path.startswith("/api/v1/sessions/"):
            session = s.session(path.rsplit("/", 1)[1])
            return {"training_run_ids": list(session.models), "sampler_ids": list(session.samplers)}
        raise BadRequest(f"no route GET {path}", 404)

    @staticmethod
    def _json(payload: dict) -> tuple[bytes, str]:
        return json.dumps(payload).encode(), "application/json"

    def _create_model(self, b: dict) -> dict:
        s, sid, seq = self.service, b.get("session_id", ""), b.get("model_seq_id", 0)
        s.session(sid)
        rank, roles, seed = s.lora_settings(b.get("base_model"), b.get("lora_config") or {})
        if (b.get("optimizer_config") or {}).get("type", "adamw") != "adamw":
            raise BadRequest(f"optimizer_config {b['optimizer_config']!r}; this server has type 'adamw'")
        return self.start(lambda: s.create_model(sid, seq, rank, roles, seed), model_id=f"{sid}:train:{seq}")

    def _optim_step(self, b: dict) -> dict:
        s, mid = self.service, b.get("model_id", "")
        s.client(mid)
        if "adam_params" not in b:
            raise BadRequest("optim_step needs adam_params (this server runs AdamW)")
        return self.start(lambda: s.optim_step(mid, b["adam_params"]), model_id=mid, seq_id=b.get("seq_id"))

    def _save_weights(self, b: dict) -> dict:
        s, mid = self.service, b.get("model_id", "")
        s.client(mid)
        name = b.get("path") or f"state-{next(self.ids)}"
        s.state_path(mid, "weights", name)  # refuses a bad name now
        return self.start(lambda: s.save_state(mid, name), model_id=mid, seq_id=b.get("seq_id"))

    def _save_for_sampler(self, b: dict) -> dict:
        s, mid = self.service, b.get("model_id", "")
        s.client(mid)
        name = b.get("path")
        if name is not None:
            s.state_path(mid, "sampler_weights", name)
        seq = b.get("sampling_session_seq_id") or 0
        return self.start(lambda: s.save_for_sampler(mid, name, mid.split(":")[0], seq), model_id=mid, seq_id=b.get("seq_id"))

    def _load_weights(self, b: dict) -> dict:
        s, path, optimizer = self.service, b.get("path", ""), bool(b.get("optimizer", False))
        s.resolve(path)
        if "model_id" in b:  # the legacy form: a new client under the same id is not what it asks
            raise BadRequest("load_weights into an existing client is not supported; use "
                             "create_training_client_from_state[_with_optimizer]")
        sid, seq = b.get("session_id", ""), b.get("model_seq_id", 0)
        s.session(sid)
        return self.start(lambda: s.load_state(sid, seq, path, optimizer), model_id=f"{sid}:train:{seq}")

    def _create_sampler(self, b: dict) -> dict:
        s = self.service
        sid = self.now(lambda: s.create_sampler(b.get("session_id", ""), b.get("sampling_session_seq_id", 0),
                                                b.get("model_path"), b.get("base_model")))
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    def _sample(self, b: dict) -> dict:
        s = self.service
        sid = b.get("sampling_session_id") or ""
        if not sid and b.get("base_model"):
            session = s.create_session()
            sid = self.now(lambda: s.create_sampler(session, 0, b.get("model_path"), b.get("base_model")))
        s.sampler(sid)
        chunks = (b.get("prompt") or {}).get("chunks") or []
        if any(c.get("type", "encoded_text") != "encoded_text" for c in chunks):
            raise BadRequest("prompt chunks must be encoded_text (no images or audio)")
        prompt = [t for c in chunks for t in c.get("tokens", [])]
        if not all(isinstance(t, int) for t in prompt):
            raise BadRequest("prompt tokens must be integers")
        n, params, want_prompt = b.get("num_samples", 1), b.get("sampling_params") or {}, bool(b.get("prompt_logprobs"))

        call = SampleCall(sid, prompt, n, params, want_prompt)
        out = self.start(lambda: self._fused_sample([call])[0], proto=True, fuse="sample", payload=call)
        out["sample_sequence_ids"] = [f"{out['request_id']}:{i}" for i in range(n if isinstance(n, int) else 0)]
        return out

    def _weights_info(self, b: dict) -> dict:
        _, _, folder = self.service.resolve(b.get("tinker_path", ""))
        meta = json.loads((folder / "state.json").read_text())
        return {"base_model": self.cfg.model, "is_lora": True, "lora_rank": meta["rank"]}


def make_handler(server: TinkerServer):
    cfg = server.cfg

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _send(self, status: int, data: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            # a JSON body always: the SDK takes an empty 400 for a proxy's rejection and retries it
            self._send(status, json.dumps({"error": message, "detail": message}).encode())

        def _authorised(self) -> bool:
            given = (self.headers.get("X-API-Key") or "").encode()
            if cfg.api_key is None or hmac.compare_digest(given, cfg.api_key.encode()):
                return True
            self.close_connection = True
            self._error(HTTPStatus.UNAUTHORIZED, "missing or wrong API key (X-API-Key)")
            return False

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/api/v1/healthz":
                return self._send(HTTPStatus.OK, b'{"status": "ok"}')
            if not self._authorised():
                return
            try:
                self._send(HTTPStatus.OK, json.dumps(server.get(path)).encode())
            except BadRequest as e:
                self._error(e.status, str(e))

        def do_POST(self) -> None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                self.close_connection = True
                return self._error(HTTPStatus.BAD_REQUEST, "bad Content-Length")
            if length > cfg.max_body_bytes or length < 0:
                drain(self.rfile, length, cfg.max_body_bytes)
                self.close_connection = True
                return self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                   f"request body of {length} bytes; this server takes at most {cfg.max_body_bytes}")
            raw = self.rfile.read(length)
            if not self._authorised():
                return
            if self.headers.get("Content-Encoding", "identity") not in ("identity", ""):
                return self._error(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "compressed request bodies are not accepted")
            try:
                data, content_type = server.post(self.path.split("?", 1)[0], raw, self.headers.get("Content-Type", ""))
                self._send(HTTPStatus.OK, data, content_type)
            except BadRequest as e:
                self._error(e.status, str(e))
            except (TypeError, ValueError, KeyError, AttributeError) as e:  # a field of the wrong type
                self._error(HTTPStatus.BAD_REQUEST, f"malformed request: {type(e).__name__}: {e}")

    return Handler


def serve_tinker(cfg: TinkerConfig, ready: threading.Event | None = None, server: TinkerServer | None = None) -> None:
    server = server or TinkerServer(cfg)
    handler = make_handler(server)
    run_http(handler, cfg.host, cfg.port, cfg.max_connections, cfg.idle_seconds, f"trillora serve --tinker: {cfg.model}",
             ready, bound=lambda httpd: server.bound(httpd))
