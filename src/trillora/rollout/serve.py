"""`trillora serve`: an OpenAI-compatible completion server over the built-in engine.

It speaks the subset of the vLLM server that RL clients use: `/v1/completions` with
token-id prompts, n samples and per-token logprobs (tokens as `token_id:N`, as vLLM's
`return_tokens_as_token_ids`), `/v1/chat/completions`, `/v1/models`, the dynamic LoRA
endpoints `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, and `/health`.

Safe by default: it binds 127.0.0.1, can require an API key, loads adapters only from
inside `adapter_root` and at most `max_adapters` of them (each is a full copy of the base), bounds
request bodies, prompts per request and their length, `n`, `max_tokens` and the connections
served at once, compares the key in constant time, answers every failure with a JSON error, and
runs one generation at a time per engine (the engine is not thread-safe; requests queue on a lock).
"""

from __future__ import annotations

import hmac
import json
import threading
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .local import LocalEngine
from .types import SamplingParams


class RequestError(Exception):
    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


@dataclass(kw_only=True)
class ServeConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    adapter_root: str | None = None
    """Adapters may only be loaded from inside this folder; None disables loading."""
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 4096
    max_n: int = 64
    max_prompts: int = 64
    """Prompts in one /v1/completions request."""
    max_adapters: int = 8
    """Adapters loaded at once: each is a full copy of the base's weights."""
    max_connections: int = 64
    """Connections served at once (one thread each); more wait in the listen queue, unrefused."""
    idle_seconds: float = 30.0
    """A kept-alive connection idle this long is closed, freeing its slot."""
    precision: str = "fp32"
    trust_remote_code: bool = False
    """Let the tokenizer run its own Python code (Kimi K2's tiktoken tokenizer)."""


class ModelServer:
    """The engines (base + one per loaded adapter) and the request logic, independent of HTTP."""

    def __init__(self, cfg: ServeConfig):
        from ..checkpoint import check_tokenizer_fits, load_model, load_tokenizer, resolve_model_path

        self.cfg = cfg
        path = resolve_model_path(cfg.model)
        self.name = cfg.model
        self.tokenizer = load_tokenizer(path, trust_remote_code=cfg.trust_remote_code)
        self.base = load_model(path)
        check_tokenizer_fits(self.tokenizer, self.base.args.vocab_size, path)
        pad = self.tokenizer.pad_token_id or 0
        self.engines: dict[str, LocalEngine] = {self.name: LocalEngine(self.base, precision=cfg.precision, pad_id=pad)}
        self.locks: dict[str, threading.Lock] = {self.name: threading.Lock()}
        self.registry_lock = threading.Lock()
        self.max_len = self.base.args.max_position_embeddings

    # --- adapters ------------------------------------------------------------------------
    def _adapter_path(self, given: str) -> Path:
        if self.cfg.adapter_root is None:
            raise RequestError(HTTPStatus.FORBIDDEN, "adapter loading is disabled (start the server with --adapter-root)")
        root = Path(self.cfg.adapter_root).resolve()
        path = (root / given).resolve() if not Path(given).is_absolute() else Path(given).resolve()
        if root != path and root not in path.parents:
            raise RequestError(HTTPStatus.FORBIDDEN, f"lora_path {given!r} is outside the adapter root")
        if not (path / "adapter_config.json").exists():
            raise RequestError(HTTPStatus.NOT_FOUND, f"no adapter at {given!r}")
        return path

    def load_adapter(self, body: dict) -> dict:
        from .. import lora
        from ..checkpoint import load_model, resolve_model_path

        name, given = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(given, str):
            raise RequestError(HTTPStatus.BAD_REQUEST, "load_lora_adapter needs string fields lora_name and lora_path")
        if name == self.name:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"lora_name {name!r} is the base model's name")
        path = self._adapter_path(given)
        with self.registry_lock:
            if name not in self.engines and len(self.engines) - 1 >= self.cfg.max_adapters:
                raise RequestError(HTTPStatus.TOO_MANY_REQUESTS, f"{self.cfg.max_adapters} adapters are loaded, the most "
                                   "this server holds (each is a copy of the base); unload one first")
        model = load_model(resolve_model_path(self.cfg.model))
        try:
            lora.load_adapter(model, path)
        except (lora.AdapterError, ValueError) as e:
            raise RequestError(HTTPStatus.BAD_REQUEST, str(e)) from None
        engine = LocalEngine(model, precision=self.cfg.precision, pad_id=self.tokenizer.pad_token_id or 0)
        with self.registry_lock:
            self.engines[name], self.locks[name] = engine, threading.Lock()
        return {"status": "ok", "lora_name": name}

    def unload_adapter(self, body: dict) -> dict:
        name = body.get("lora_name")
        with self.registry_lock:
            if name == self.name or name not in self.engines:
                raise RequestError(HTTPStatus.NOT_FOUND, f"no adapter named {name!r}")
            del self.engines[name], self.locks[name]
        return {"status": "ok", "lora_name": name}

    def models(self) -> dict:
        with self.registry_lock:
            names = list(self.engines)
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "trillora",
                                              "parent": None if n == self.name else self.name} for n in names]}

    # --- completions ---------------------------------------------------------------------
    def _prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise RequestError(HTTPStatus.BAD_REQUEST, "prompt must be a string, a list of token ids, or a list of those")
        if len(prompt) > self.cfg.max_prompts:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"{len(prompt)} prompts; at most {self.cfg.max_prompts} per request")
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append(self.tokenizer(p, add_special_tokens=False)["input_ids"])
            elif isinstance(p, list) and p and all(isinstance(t, int) and 0 <= t < len(self.tokenizer) for t in p):
                out.append(p)
            else:
                raise RequestError(HTTPStatus.BAD_REQUEST, "each prompt must be a non-empty string or list of valid token ids")
        return out

    def _check_lengths(self, prompts: list[list[int]], max_tokens: int) -> None:
        for p in prompts:
            if len(p) + max_tokens > self.max_len:
                raise RequestError(HTTPStatus.BAD_REQUEST, f"a prompt of {len(p)} tokens plus max_tokens={max_tokens} "
                                   f"is over the model's {self.max_len} positions")

    def _params(self, body: dict) -> tuple[SamplingParams, int]:
        n = body.get("n", 1)
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(n, int) or not 1 <= n <= self.cfg.max_n:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"n must be an integer in 1..{self.cfg.max_n}")
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= self.cfg.max_tokens_limit:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"max_tokens must be an integer in 1..{self.cfg.max_tokens_limit}")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"seed must be an integer, not {type(seed).__name__}")
        stop = body.get("stop_token_ids") or []
        if not isinstance(stop, list) or not all(isinstance(t, int) and 0 <= t < len(self.tokenizer) for t in stop):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"stop_token_ids must be a list of token ids in 0..{len(self.tokenizer) - 1}")
        stop = tuple(stop)
        if self.tokenizer.eos_token_id is not None and not body.get("ignore_eos", False):
            stop = stop + (self.tokenizer.eos_token_id,)
        try:
            params = SamplingParams(max_new_tokens=max_tokens, temperature=float(body.get("temperature", 1.0)),
                                    top_p=float(body.get("top_p", 1.0)), top_k=max(0, int(body.get("top_k", 0) or 0)),
                                    stop_token_ids=stop, seed=seed)
        except (TypeError, ValueError) as e:
            raise RequestError(HTTPStatus.BAD_REQUEST, str(e)) from None
        return params, n

    def _engine(self, model: str | None) -> tuple[LocalEngine, threading.Lock]:
        with self.registry_lock:
            name = model or self.name
            if name not in self.engines:
                raise RequestError(HTTPStatus.NOT_FOUND, f"model {name!r} is not loaded; loaded: {', '.join(self.engines)}")
            return self.engines[name], self.locks[name]

    def complete(self, body: dict, chat: bool = False) -> dict:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError(HTTPStatus.BAD_REQUEST, "messages must be a non-empty list")
            if not getattr(self.tokenizer, "chat_template", None):
                raise RequestError(HTTPStatus.BAD_REQUEST, "this model's tokenizer has no chat template")
            try:  # text, then ids: tokenize=True gives a BatchEncoding in transformers 5
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # a malformed message: the template's own error  # noqa: BLE001
                raise RequestError(HTTPStatus.BAD_REQUEST, f"messages do not fit the chat template: {e}") from None
            prompts = [self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        else:
            prompts = self._prompts(body.get("prompt"))
        params, n = self._params(body)
        self._check_lengths(prompts, params.max_new_tokens)
        engine, lock = self._engine(body.get("model"))
        with lock:
            groups = engine.generate(prompts, n, params)
        choices = []
        for i, c in enumerate(c for g in groups for c in g):
            text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": c.finish_reason})
                continue
            choice = {"index": i, "text": text, "finish_reason": c.finish_reason, "token_ids": c.token_ids}
            if body.get("logprobs") is not None:
                choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in c.token_ids], "token_logprobs": c.logprobs}
            choices.append(choice)
        used = sum(len(c.token_ids) for g in groups for c in g)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": body.get("model") or self.name, "choices": choices,
                "usage": {"prompt_tokens": sum(len(p) for p in prompts) * n, "completion_tokens": used}}


def make_handler(server: ModelServer):
    routes_post = {
        "/v1/completions": lambda b: server.complete(b),
        "/v1/chat/completions": lambda b: server.complete(b, chat=True),
        "/v1/load_lora_adapter": server.load_adapter,
        "/v1/unload_lora_adapter": server.unload_adapter,
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: one line per request is noise under RL load
            pass

        def _send(self, status: HTTPStatus, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            if self.close_connection:  # tell the client, so it opens a new connection for its next request
                self.send_header("Connection", "close")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorised(self) -> bool:
            key = server.cfg.api_key
            given = self.headers.get("Authorization") or ""
            if key is None or hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return True
            self.close_connection = True  # an unread body must not be taken for the next request
            self._send(HTTPStatus.UNAUTHORIZED, {"error": {"message": "missing or wrong API key"}})
            return False

        def do_GET(self) -> None:
            if self.path == "/health":
                return self._send(HTTPStatus.OK, {"status": "ok"})
            if not self._authorised():
                return
            if self.path == "/v1/models":
                return self._send(HTTPStatus.OK, server.models())
            self._send(HTTPStatus.NOT_FOUND, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            if not self._authorised():
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0:  # read as "until EOF" it would bypass the body limit and block the handler
                self.close_connection = True
                return self._send(HTTPStatus.BAD_REQUEST, {"error": {"message": "bad Content-Length"}})
            if length > server.cfg.max_body_bytes:
                drain(self.rfile, length, server.cfg.max_body_bytes)
                self.close_connection = True
                return self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": {"message": "request body too large"}})
            raw = self.rfile.read(length)  # read before anything else, so the connection stays in step
            route = routes_post.get(self.path)
            if route is None:
                return self._send(HTTPStatus.NOT_FOUND, {"error": {"message": f"no route {self.path}"}})
            try:
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise RequestError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
                self._send(HTTPStatus.OK, route(body))
            except json.JSONDecodeError as e:
                self._send(HTTPStatus.BAD_REQUEST, {"error": {"message": f"invalid JSON: {e.msg}"}})
            except RequestError as e:
                self._send(e.status, {"error": {"message": str(e)}})
            except (TypeError, ValueError, KeyError, AttributeError) as e:  # a field of a type no check foresaw
                self._send(HTTPStatus.BAD_REQUEST, {"error": {"message": f"malformed request: {type(e).__name__}: {e}"}})
            except Exception as e:  # noqa: BLE001 - the client gets an answer, never a dropped connection
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": f"{type(e).__name__}: {e}"}})

    return Handler


def drain(rfile, length: int, limit: int) -> None:
    """Read and drop a moderately oversized body (up to 16 × `limit`), so the client reads the
    413 instead of a reset; the rest is dropped with the connection."""
    left = min(max(length, 0), 16 * limit)
    while left > 0:
        chunk = rfile.read(min(left, 1 << 16))
        if not chunk:
            break
        left -= len(chunk)


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` at once: the accept loop waits for a free
    slot, so a burst queues in the kernel's listen backlog instead of spawning unbounded threads."""

    daemon_threads = True
    request_queue_size = 1024

    def __init__(self, address, handler, max_connections: int):
        self.slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        self.slots.acquire()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def run_http(handler, host: str, port: int, max_connections: int, idle_seconds: float, name: str,
             ready: threading.Event | None = None, bound=None) -> None:
    """Serve `handler` until interrupted (or `httpd.shutdown()`); prints where, then sets `ready`
    (`bound(httpd)` first: the port it got, a handle to stop it)."""
    handler.timeout = idle_seconds  # socket timeout: idle keep-alive connections end
    httpd = BoundedHTTPServer((host, port), handler, max_connections)
    port = httpd.server_address[1]
    if bound is not None:
        bound(httpd)
    print(f"{name} on http://{host}:{port}", flush=True)
    if ready is not None:
        ready.set()
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()


def serve(cfg: ServeConfig, ready: threading.Event | None = None) -> None:
    run_http(make_handler(ModelServer(cfg)), cfg.host, cfg.port, cfg.max_connections, cfg.idle_seconds,
             f"trillora serve: {cfg.model}", ready)
