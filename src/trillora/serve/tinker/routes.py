"""`trillora serve MODEL --tinker`: the Tinker routes (the REST API the `tinker` SDK calls) on the service.

Operations that compute (create_model, forward[_backward], optim_step, save / load, sample)
return a future id at once and run on ONE worker thread (`serve.worker`: each client's requests
in `seq_id` order; forward_backward calls and samples that wait together share one pass); the
SDK then polls `retrieve_future`, which holds the poll until the result is there (or
`poll_seconds` passed: `try_again`). Forward, forward_backward and
sample results go back as protobuf (`wire`), everything else as JSON.

Requests that cannot succeed (unknown model, rank 0, a datum whose lengths disagree, an
unknown loss, a body too large or not the message it claims) are refused when they arrive,
with a 4xx and a message; a failure found while running comes back as the future's error.
The key, body bounds and time limits are the HTTP layer's (`serve.http`); saved states live only
under `state_dir`. retrieve_future waits on the event loop, holding no thread while it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from pathlib import Path

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool

from ..calls import BadRequest, SampleCall
from ..face import Server
from ..http import json_object, owner_of
from ..registry import SERVED
from ..worker import Job, Replayed
from . import hosted, states, wire
from .checkpoints import CheckpointStore
from .checks import sample_options
from .futures import PROTO, Futures
from .service import FwdBwd, TinkerService

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": True,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "custom_loss_server_side": False,
}


class TinkerRoutes:
    def __init__(self, server: Server):
        self.server, self.cfg, self.worker = server, server.cfg, server.worker
        self.service: TinkerService = server.service  # the whole service: the Tinker verbs
        self.futures = Futures(self.worker, self.cfg.poll_seconds, self.cfg.max_unread_mib << 20, self.cfg.max_futures)
        self.ids = itertools.count()  # names of states saved without one
        self.router = APIRouter()
        self.router.add_api_route("/api/v1/healthz", self.health, methods=["GET"])
        self.router.add_api_route("/api/v1/{rest:path}", self.handle, methods=["GET", "POST", "PUT", "DELETE"])
        self.store = CheckpointStore(self.service.root, self.cfg.model, int(self.cfg.max_state_gib * 2**30))
        self.store.live = lambda sid: sid in self.service.sessions
        threading.Thread(target=self._sweep, daemon=True, name="checkpoint-ttl").start()

    def _sweep(self, every: float = 30.0) -> None:
        """Checkpoints past their TTL are deleted in the background (and before every listing)."""
        while True:
            time.sleep(every)
            with contextlib.suppress(OSError):
                self.store.sweep()

    def health(self) -> dict:
        if not self.worker.alive:
            raise BadRequest("the service's worker has stopped; restart the server", 503)
        return {"status": "ok"}

    async def handle(self, request: Request) -> Response:
        self.futures.loop = asyncio.get_running_loop()
        path = request.url.path
        hosted.refuse(request.method, path)  # a hosted service's route: a 4xx naming why, never one the SDK retries
        if request.method == "GET":
            return _json_response(await run_in_threadpool(self.get, path))
        if request.method in ("PUT", "DELETE") or path.endswith("/publish"):  # a checkpoint's lifecycle
            body = _json_object(await request.body()) if request.method == "PUT" else {}
            return _json_response(await run_in_threadpool(self.store.change, request.method, path, body))
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise BadRequest("compressed request bodies are not accepted", 415)
        raw = await request.body()
        if path == "/api/v1/retrieve_future":
            data, content_type = await self.futures.retrieve(_json_object(raw))
        else:
            data, content_type = await run_in_threadpool(
                self.post, path, raw, request.headers.get("content-type", ""), owner_of(request.scope)
            )
        return Response(data, media_type=content_type)

    # --- routes --------------------------------------------------------------------------
    def post(self, path: str, raw: bytes, content_type: str, owner: str = "") -> tuple[bytes, str]:
        """`owner`: the request's key digest (`http.owner_of`): what it opens and queues counts against that key."""
        s = self.service
        if path == "/api/v1/forward_backward":
            if PROTO not in content_type:
                raise BadRequest(f"forward_backward takes {PROTO} bodies, not {content_type or 'none'}", 415)
            try:
                req = wire.read_forward_backward(raw, self.cfg.max_call_tokens)
            except wire.WireError as e:
                raise BadRequest(f"forward_backward body: {e}") from None
            with self._in_order(req.model_id, req.seq_id):
                s.client(req.model_id)
                tensors = s.check_data(req.loss_fn, req.loss_fn_config, req.data)  # refused now, not in the future
            call = FwdBwd(req.model_id, req.loss_fn, req.loss_fn_config, req.data, tensors, req.forward_only)
            encode = lambda o: wire.forward_backward_output({"logprobs": o[0]}, o[1], len(call.data))  # noqa: E731
            return self._json(
                self.futures.start(
                    owner,
                    lambda: s.forward_backward_many([call])[0],
                    proto=True,
                    model_id=req.model_id,
                    seq_id=req.seq_id,
                    fuse="forward_backward",
                    payload=call,
                    encode=encode,
                )
            )
        body = _json_object(raw)
        handler = self._routes(owner).get(path)
        if handler is None and path.startswith("/api/v1/sessions/") and path.endswith("/finish"):
            sid = path.split("/")[-2]
            if sid in s.sessions and sid != SERVED:
                self._end([sid], owner)
            return self._json({})
        if handler is None:
            raise BadRequest(f"no route POST {path}", 404)
        if "seq_id" not in body:
            return self._json(handler(body))
        with self._in_order(body.get("model_id"), body["seq_id"]):
            return self._json(handler(body))

    @contextlib.contextmanager
    def _in_order(self, model_id, seq_id):
        """A request of a client's numbered sequence: a non-integer number is refused; a refused request
        still takes its place in the sequence (the worker runs a no-op there), so the client's next
        request is not held waiting for it. A 429 keeps its number free: the SDK sends it again."""
        if seq_id is not None and (not isinstance(seq_id, int) or isinstance(seq_id, bool) or seq_id < 0):
            raise BadRequest(f"seq_id={seq_id!r}; allowed: an integer >= 0")
        try:
            yield
        except BadRequest as e:
            if isinstance(model_id, str) and seq_id is not None and e.status != 429:
                with contextlib.suppress(Replayed):  # a replay is refused, and its number was taken already
                    self.worker.submit(Job(lambda: None, lambda out: None, model_id), seq_id)
            raise

    def _routes(self, owner: str) -> dict:
        s = self.service
        return {
            "/api/v1/client/config": lambda b: CLIENT_CONFIG,
            "/api/v1/client/dynamic_config": lambda b: {"refresh_interval_sec": 300},
            "/api/v1/telemetry": lambda b: {"status": "accepted"},
            "/api/v1/create_session": lambda b: self._create_session(b, owner),
            "/api/v1/session_heartbeat": lambda b: (s.session(b.get("session_id", "")), {"type": "session_heartbeat"})[
                1
            ],
            "/api/v1/create_model": lambda b: self._create_model(b, owner),
            "/api/v1/get_info": lambda b: s.info(b.get("model_id", "")),
            "/api/v1/optim_step": lambda b: self._optim_step(b, owner),
            "/api/v1/save_weights": lambda b: self._save_weights(b, owner),
            "/api/v1/save_weights_for_sampler": lambda b: self._save_for_sampler(b, owner),
            "/api/v1/load_weights": lambda b: self._load_weights(b, owner),
            "/api/v1/create_sampling_session": lambda b: self._create_sampler(b, owner),
            "/api/v1/asample": lambda b: self._sample(b, owner),
            "/api/v1/weights_info": lambda b: self._weights_info(b, owner),
        }

    def get(self, path: str) -> dict:
        s = self.service
        if path == "/api/v1/get_server_capabilities":
            return s.capabilities()
        if path.rsplit("/", 1)[1].split(":")[0] == SERVED:
            raise BadRequest(f"no route GET {path}", 404)
        if path.startswith("/api/v1/samplers/"):
            sid = path.rsplit("/", 1)[1]
            s.sampler(sid)
            return {"sampler_id": sid, "base_model": s.cfg.model}
        if path.startswith("/api/v1/sessions/"):
            session = s.session(path.rsplit("/", 1)[1])
            return {"training_run_ids": list(session.models), "sampler_ids": list(session.samplers)}
        if path.startswith("/api/v1/training_runs/"):
            return self.store.get(path, s.registry)
        raise BadRequest(f"no route GET {path}", 404)

    @staticmethod
    def _json(payload: dict) -> tuple[bytes, str]:
        return json.dumps(payload).encode(), "application/json"

    def _create_session(self, b: dict, owner: str = "") -> dict:
        s = self.service
        idle = s.idle_sessions()
        if idle:  # their clients and samplers freed first (on the worker: a parallel service's ranks follow)
            self._end(idle, owner)
        return {"type": "create_session", "session_id": s.create_session(owner)}

    def _create_model(self, b: dict, owner: str = "") -> dict:
        s, sid, seq = self.service, b.get("session_id", ""), _seq(b, "model_seq_id")
        if f"{sid}:train:{seq}" in s.session(sid).models:
            raise BadRequest(f"model_seq_id {seq} of this session is taken by {sid}:train:{seq}", 409)
        rank, roles, seed = s.lora_settings(b.get("base_model"), b.get("lora_config") or {})
        if (b.get("optimizer_config") or {}).get("type", "adamw") != "adamw":
            raise BadRequest(f"optimizer_config {b['optimizer_config']!r}; this server has type 'adamw'")
        metadata = self._metadata(b)

        def create() -> dict:
            if metadata:  # counted with the saved states
                self.store.check_room()
            out = s.create_model(sid, seq, rank, roles, seed)
            self.store.record_run(out["model_id"], rank, roles, metadata)
            return out

        return self.futures.start(owner, create, model_id=f"{sid}:train:{seq}")

    def _optim_step(self, b: dict, owner: str = "") -> dict:
        s, mid = self.service, b.get("model_id", "")
        s.client(mid)
        if "adam_params" not in b:
            raise BadRequest("optim_step needs adam_params (this server runs AdamW)")
        return self.futures.start(
            owner, lambda: s.optim_step(mid, b["adam_params"]), model_id=mid, seq_id=b.get("seq_id")
        )

    def _save_weights(self, b: dict, owner: str = "") -> dict:
        s, mid = self.service, b.get("model_id", "")
        s.client(mid)
        name = b.get("path") or f"state-{next(self.ids)}"
        s.state_path(mid, "weights", name)  # refuses a bad name now
        self.store.check_room()
        ttl, metadata = b.get("ttl_seconds"), self._metadata(b)
        self.store.check_ttl(ttl)  # before anything is written

        def save() -> dict:
            self.store.check_room()  # again on the worker: saves queued together all passed the first check
            try:
                out = s.save_state(mid, name)
                self.store.annotate(out["path"], ttl, metadata)
            finally:  # what reached the disk counts, whatever failed after
                self.store.recount(self.store.run_folder(mid))
            return out

        return self.futures.start(owner, save, model_id=mid, seq_id=b.get("seq_id"))

    def _save_for_sampler(self, b: dict, owner: str = "") -> dict:
        s, mid = self.service, b.get("model_id", "")
        s.client(mid)
        name = b.get("path")
        if name is not None:
            s.state_path(mid, "sampler_weights", name)
            self.store.check_room()
        seq, ttl, metadata = _seq(b, "sampling_session_seq_id"), b.get("ttl_seconds"), self._metadata(b)
        self.store.check_ttl(ttl)

        def save() -> dict:
            if name is not None:
                self.store.check_room()
            try:
                out = s.save_for_sampler(mid, name, mid.split(":")[0], seq)
                if "path" in out:  # a named revision is a checkpoint: its TTL and metadata apply
                    self.store.annotate(out["path"], ttl, metadata)
            finally:
                self.store.recount(self.store.run_folder(mid))
            return out

        return self.futures.start(owner, save, model_id=mid, seq_id=b.get("seq_id"))

    def _load_weights(self, b: dict, owner: str = "") -> dict:
        s, path, optimizer = self.service, b.get("path", ""), bool(b.get("optimizer", False))
        self._readable(path, owner)
        if "model_id" in b:  # the legacy form: a new client under the same id is not what it asks
            raise BadRequest(
                "load_weights into an existing client is not supported; use "
                "create_training_client_from_state[_with_optimizer]"
            )
        sid, seq = b.get("session_id", ""), _seq(b, "model_seq_id")
        if f"{sid}:train:{seq}" in s.session(sid).models:
            raise BadRequest(f"model_seq_id {seq} of this session is taken by {sid}:train:{seq}", 409)
        metadata = self._metadata(b)

        def load() -> dict:
            if metadata:
                self.store.check_room()
            out = s.load_state(sid, seq, path, optimizer)
            c = s.client(out["model_id"])
            self.store.record_run(out["model_id"], c.rank, c.roles, metadata)
            return out

        return self.futures.start(owner, load, model_id=f"{sid}:train:{seq}")

    def _create_sampler(self, b: dict, owner: str = "") -> dict:
        s = self.service
        seq = _seq(b, "sampling_session_seq_id")
        if b.get("model_path"):
            self._readable(b["model_path"], owner)
        sid = self.futures.now(
            lambda: s.create_sampler(b.get("session_id", ""), seq, b.get("model_path"), b.get("base_model")), owner
        )
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    def _sample(self, b: dict, owner: str = "") -> dict:
        s = self.service
        sid = b.get("sampling_session_id") or ""
        if not sid and b.get("model_path"):
            raise BadRequest("asample of a model_path needs its sampling_session_id (create_sampling_session first)")
        if not sid and b.get("base_model"):  # the base itself: its one revision, no session held per request
            s.check_base_model(b["base_model"])
            sid = f"{SERVED}:sample:{self.cfg.model}"
        s.sampler(sid)
        chunks = (b.get("prompt") or {}).get("chunks") or []
        if any(c.get("type", "encoded_text") != "encoded_text" for c in chunks):
            raise BadRequest("prompt chunks must be encoded_text (no images or audio)")
        prompt = [t for c in chunks for t in c.get("tokens", [])]
        if not all(type(t) is int for t in prompt):  # not true / false either
            raise BadRequest("prompt tokens must be integers")
        n, params, want_prompt = b.get("num_samples", 1), b.get("sampling_params") or {}, bool(b.get("prompt_logprobs"))
        if not isinstance(n, int) or not 1 <= n <= self.cfg.max_samples:  # before anything is built from it
            raise BadRequest(f"num_samples={n!r}; allowed: 1..{self.cfg.max_samples}")

        calls = [SampleCall(sid, prompt, n, params, want_prompt, options=sample_options(b, len(prompt), s.vocab))]
        s.check_sample(calls[0])  # refused now, not in the future
        out = self.futures.start(
            owner,
            lambda: self.server.sample([calls])[0],
            proto=True,
            fuse="sample",
            payload=calls,
            encode=lambda o: wire.sample_response(*o[0]),
        )
        out["sample_sequence_ids"] = [f"{out['request_id']}:{i}" for i in range(n)]
        return out

    def _end(self, sids: list[str], owner: str) -> None:
        """Sessions' clients and samplers freed (on the worker: a parallel service's ranks follow), and
        the records of their runs that no saved state names."""
        self.futures.now(lambda: self.service.end_sessions(sids), owner)
        self.store.end_runs(sids)

    def _metadata(self, body: dict) -> dict | None:
        """A request's `user_metadata`, kept with its run or checkpoint (anything but an object is
        ignored), at most `--max-metadata-kib` of JSON."""
        metadata = body.get("user_metadata")
        if not isinstance(metadata, dict):
            return None
        size, bound = len(json.dumps(metadata).encode()), self.cfg.max_metadata_kib
        if size > bound * 1024:
            raise BadRequest(
                f"user_metadata holds {size} bytes of JSON; the server keeps at most {bound} KiB (--max-metadata-kib)"
            )
        return metadata

    def _readable(self, path: str, owner: str) -> Path:
        """The folder of a tinker:// path this key may read: a run's checkpoint (`tinker://runs/...`,
        names anyone can guess) only with the operator's key when there are several."""
        _, kind, folder = self.service.resolve(path)
        operator = self.cfg.operator()
        if kind == "checkpoint" and operator is not None and owner != operator:
            raise BadRequest("reading a run's checkpoint needs the operator's key (the first --api-key)", 403)
        return folder

    def _weights_info(self, b: dict, owner: str = "") -> dict:
        path = b.get("tinker_path", "")
        saved = states.saved_state(self._readable(path, owner), self.service.resolve(path)[1], path, tensors=False)
        roles = set(saved.lora["targets"])
        return {
            "base_model": self.cfg.model,
            "is_lora": True,
            "lora_rank": saved.lora["rank"],
            "train_attn": "attention" in roles,
            "train_mlp": bool(roles & {"mlp", "shared_experts", "experts"}),
            "train_unembed": "lm_head" in roles,
        }


def _seq(body: dict, key: str) -> int:
    """A client's or sampler's number in its session (the SDK counts them from 0)."""
    seq = body.get(key) or 0
    if type(seq) is not int or not 0 <= seq < 2**31:
        raise BadRequest(f"{key}={seq!r}; allowed: an integer in 0..2**31-1")
    return seq


def _json_object(raw: bytes) -> dict:
    body = json_object(raw)
    for key in ("session_id", "model_id", "sampling_session_id"):  # the OpenAI routes' revisions are theirs alone
        if isinstance(body.get(key), str) and body[key].split(":")[0] == SERVED:
            raise BadRequest(f"unknown {key} {body[key]!r}", 404)
    return body


def _json_response(payload: dict) -> Response:
    return Response(json.dumps(payload), media_type="application/json")
