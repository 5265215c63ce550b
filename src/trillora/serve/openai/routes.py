"""`trillora serve MODEL`: the OpenAI routes on the resident base.

The subset of vLLM's server that RL clients use: `/v1/completions` with token-id prompts, n
samples and per-token logprobs (tokens as `token_id:N`, as vLLM's `return_tokens_as_token_ids`),
`/v1/chat/completions`, `/v1/models`, the dynamic LoRA routes `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`, and `/health`. With `--record STORE`, every completion is written to the
trace store (`trillora.traces`) before its response goes out, under a trace id the client names
(`X-Trace-Id`, or `metadata.trace_id`) or the server makes and returns; `/v1/feedback` scores a
trace. `return_token_ids` (vLLM's) returns the served ids, so a client never re-tokenizes text.

A loaded adapter is a revision in the base's adapter slots (its tensors only, never a copy of the
base), so how many fit is a matter of memory (`adapter_memory_mib`, reported in /v1/models). A
request's prompts wait on the service's worker like the Tinker samples do: requests for different
adapters that wait together are sampled in one pass, each row with its own adapter.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
import uuid
from pathlib import Path

import torch
from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool

from ... import lora
from ...chat.renderer import ChatRenderer
from ...checkpoint.weights import base_fingerprint
from ...errors import ConfigError
from ...lora import AdapterError
from ...tasks.prompts import encode_prompt
from ...traces import Call, Feedback, Recorder, TooMuchFeedback, TraceError, UnknownTrace
from ..calls import BadRequest, SampleCall
from ..face import Server
from ..http import check_operator, json_object, owner_of
from ..worker import outcome_of
from .requests import sampling_params, text_field, trace_of

NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "trillora_adapter.json")


class OpenAIRoutes:
    def __init__(self, server: Server):
        self.server, self.cfg, self.service = server, server.cfg, server.service
        self.tokenizer = self.service.tokenizer
        self.base_fingerprint = base_fingerprint(self.service.path)  # what an adapter's trillora_adapter.json names
        self.max_len = self.service.base.model.args.max_position_embeddings
        self.base_bytes = sum(
            p.numel() * p.element_size() for n, p in self.service.base.model.named_parameters() if ".lora_" not in n
        )
        self.adapter_limit = (
            _available_bytes(self.service.device) // 2
            if self.cfg.adapter_memory_mib is None
            else int(self.cfg.adapter_memory_mib * (1 << 20))
        )
        cfg = self.cfg
        self.recorder = Recorder(cfg.record, cfg.max_trace_rows, cfg.max_trace_mib) if cfg.record else None
        try:
            self.renderer = ChatRenderer(self.tokenizer)
        except ConfigError:  # no chat template: /v1/chat/completions answers 400
            self.renderer = None
        r = self.router = APIRouter()
        r.add_api_route("/health", self.health, methods=["GET"])
        r.add_api_route("/v1/recording", self.recording, methods=["GET"])
        r.add_api_route("/v1/feedback", self.feedback, methods=["POST"])
        r.add_api_route("/v1/models", self.models, methods=["GET"])
        r.add_api_route("/v1/completions", self.completions, methods=["POST"])
        r.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        r.add_api_route("/v1/load_lora_adapter", self.load_adapter, methods=["POST"])
        r.add_api_route("/v1/unload_lora_adapter", self.unload_adapter, methods=["POST"])

    # --- adapters ------------------------------------------------------------------------
    def _adapter_path(self, given: str) -> Path:
        """The adapter folder `given` names, it and its files (links followed) inside the adapter root."""
        if self.cfg.adapter_root is None:
            raise BadRequest("adapter loading is disabled (start the server with --adapter-root)", 403)
        root = Path(self.cfg.adapter_root).resolve()
        try:
            path = lora.adapter_folder((root / given).resolve())  # an absolute `given` replaces the root
            files = [(path / f).resolve() for f in ADAPTER_FILES if (path / f).exists()]
            meant = lora.adapter_folder(Path(given).resolve())  # a path from the server's working folder
            hint = f": try {str(meant.relative_to(root))!r}" if root in meant.parents and meant.is_dir() else ""
        except (OSError, RuntimeError, ValueError) as e:  # too long, a link loop, a NUL byte
            raise BadRequest(f"lora_path {given!r} cannot be read: {type(e).__name__}") from None
        if any(root != p and root not in p.parents for p in [path, *files]):
            raise BadRequest(f"lora_path {given!r} is outside the adapter root (--adapter-root)", 403)
        if not (path / "adapter_config.json").exists():
            raise BadRequest(
                f"no adapter at {given!r} (lora_path is resolved against --adapter-root{hint}; "
                "trillora train writes runs/<name>/adapter/fused and .../per_expert)",
                404,
            )
        return path

    async def load_adapter(self, request: Request) -> dict:
        check_operator(request.scope, self.cfg.operator(), "load_lora_adapter")
        body = await _body(request)
        name, given = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not NAME.fullmatch(name) or not isinstance(given, str):
            raise BadRequest(
                "load_lora_adapter needs string fields lora_name (1-128 letters, digits, '.', '_', ':', '/' "
                "or '-') and lora_path"
            )
        if name == self.cfg.model:
            raise BadRequest(f"lora_name {name!r} is the base model's name")
        path = self._adapter_path(given)
        await outcome_of(self.server.worker, lambda: self._load(name, path))  # on the worker: it fills the slots
        return {"status": "ok", "lora_name": name}

    def _load(self, name: str, path: Path) -> None:
        trained_on = lora.adapter_base(path)
        if trained_on is not None and trained_on != self.base_fingerprint:
            raise BadRequest(
                f"adapter {name!r} was trained on another base (fingerprint {trained_on}, "
                f"adapter_config.json names it); this server's base {self.cfg.model!r} is {self.base_fingerprint}"
            )
        try:
            revision = self.service.base.revision_from_folder(path)
        except (AdapterError, ValueError) as e:
            raise BadRequest(str(e)) from None
        # a replaced name frees its bytes
        room = self.adapter_limit - sum(r.bytes() for n, r in self.service.served().items() if n != name)
        if revision.bytes() > room:
            raise BadRequest(
                f"adapter {name!r} holds {revision.bytes() / 2**20:.1f} MiB; {max(room, 0) / 2**20:.1f} MiB of the "
                "adapter memory is free (--adapter-memory-mib): unload one first"
            )  # 400: retrying cannot help
        self.service.serve_adapter(name, revision)

    async def unload_adapter(self, request: Request) -> dict:
        check_operator(request.scope, self.cfg.operator(), "unload_lora_adapter")
        name = (await _body(request)).get("lora_name")
        if not isinstance(name, str):
            raise BadRequest("unload_lora_adapter needs a string field lora_name")
        self.service.unserve_adapter(name)
        return {"status": "ok", "lora_name": name}

    async def models(self, request: Request) -> dict:
        """Every served name; a learning server's revisions (`NAME@k`) carry their revision number,
        gate score (when gated) and whether `NAME` serves them now."""
        served = self.service.served()
        held = {n: r.bytes() for n, r in served.items()}
        revisions = self.server.revisions
        revisions = revisions.models(revisions.operator(request.scope)) if revisions is not None else {}
        return {
            "object": "list",
            "data": [
                {
                    "id": n,
                    "object": "model",
                    "owned_by": "trillora",
                    "parent": None if n == self.cfg.model else self.cfg.model,
                    "max_model_len": self.max_len,
                    "adapter_bytes": held[n],
                    **revisions.get(n, {}),
                }
                for n in served
            ],
            "adapter_memory": {
                "base_bytes": self.base_bytes,
                "held_bytes": sum(held.values()),
                "limit_bytes": self.adapter_limit,
            },
        }

    # --- completions ---------------------------------------------------------------------
    def _prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest("prompt must be a string, a list of token ids, or a list of those")
        if len(prompt) > self.cfg.max_prompts:
            raise BadRequest(f"{len(prompt)} prompts; at most {self.cfg.max_prompts} per request")
        out = []
        for p in prompt:
            if isinstance(p, str) and len(p) > 64 * self.max_len:  # bounded before the tokenizer runs
                raise BadRequest(
                    f"a prompt of {len(p)} characters is longer than the model's {self.max_len} positions can hold"
                )
            if isinstance(p, str):
                out.append(encode_prompt(self.tokenizer, p))  # as the trainer encodes its prompts
            elif isinstance(p, list) and p and all(isinstance(t, int) and 0 <= t < len(self.tokenizer) for t in p):
                out.append(p)
            else:
                raise BadRequest("each prompt must be a non-empty string or list of valid token ids")
        return out

    def _chat_prompt(self, messages, tools=None) -> list[list[int]]:
        """The conversation rendered as the envs render it (`tasks.renderer.ChatRenderer`)."""
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise BadRequest("tools must be a list of objects ({'type': 'function', 'function': {...}})")
        if self.renderer is None:
            raise BadRequest("this model's tokenizer has no chat template")
        chars = len(json.dumps([messages, tools], ensure_ascii=False, default=str))
        if chars > 64 * self.max_len:  # bounded before the template and the tokenizer run
            raise BadRequest(
                f"messages and tools of {chars} characters: more than the model's {self.max_len} positions can hold"
            )
        if tools:
            try:
                self.renderer.tool_format  # noqa: B018 - raises when the template has no tool calls
            except ConfigError as e:
                raise BadRequest(f"tools: {e}") from None
        try:
            return [self.renderer.prompt(messages, tools)]
        except Exception as e:  # a malformed message: the template's own error  # noqa: BLE001
            raise BadRequest(f"messages do not fit the chat template: {e}") from None

    # prompts are tokenized and chats rendered on the threadpool: a body's worth of text takes seconds,
    # which on the event loop would hold every other connection (the health checks among them)
    async def completions(self, request: Request, response: Response) -> dict:
        body = await self._recorded_body(request)
        prompts = await run_in_threadpool(self._prompts, body.get("prompt"))
        return await self._complete(request, response, body, prompts, chat=False)

    async def chat_completions(self, request: Request, response: Response) -> dict:
        body = await self._recorded_body(request)
        prompts = await run_in_threadpool(self._chat_prompt, body.get("messages"), body.get("tools"))
        return await self._complete(request, response, body, prompts, chat=True)

    async def _complete(
        self, request: Request, response: Response, body: dict, prompts: list[list[int]], chat: bool
    ) -> dict:
        params, n = sampling_params(body, self.cfg, self.tokenizer)
        if chat:  # a turn ends at the template's end-of-turn token (and, for Harmony, at a call)
            params["stop"] = sorted({*params["stop"], *self.renderer.stop_tokens})
        trace_id, user_id, tag = trace_of(request, body)
        for p in prompts:
            if len(p) + params["max_tokens"] > self.max_len:
                raise BadRequest(
                    f"a prompt of {len(p)} tokens plus max_tokens={params['max_tokens']} "
                    f"is over the model's {self.max_len} positions"
                )
        total = n * sum(len(p) + params["max_tokens"] for p in prompts)
        if total > self.cfg.max_call_tokens:  # the request's time on the engine is bounded by it
            raise BadRequest(
                f"n={n} × {len(prompts)} prompts × (prompt + max_tokens={params['max_tokens']}) is {total} "
                f"tokens; at most {self.cfg.max_call_tokens} per request (--max-call-tokens)"
            )
        name, served = body.get("model") or self.cfg.model, self.service.served()
        if name not in served:
            raise BadRequest(f"model {name!r} is not loaded; loaded: {', '.join(served)}", 404)
        revision = served[name]
        calls = [SampleCall(revision.sampler_id, p, n, params) for p in prompts]
        try:
            outcomes = await outcome_of(
                self.server.worker,
                lambda: self.server.sample([calls])[0],
                fuse="sample",
                payload=calls,
                owner=owner_of(request.scope),
            )
        except BadRequest as e:
            if e.status == 404:  # unloaded while the request waited
                raise BadRequest(f"model {name!r} is not loaded", 404) from None
            raise
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        served_calls = [(p, c) for p, (completions, *_) in zip(prompts, outcomes, strict=True) for c in completions]
        choices, records, ids = [], [], body.get("return_token_ids") is True
        for i, (prompt, (tokens, logprobs, reason)) in enumerate(served_calls):
            tool_calls = []
            if chat:  # the renderer decodes and parses the turn; a completion is its decoded text
                turn = self.renderer.parse(tokens, with_tools=bool(body.get("tools")))
                tool_calls = [
                    {
                        "id": f"call_{secrets.token_hex(8)}",
                        "type": "function",
                        "function": {"name": t.name, "arguments": json.dumps(t.arguments)},
                    }
                    for t in turn.parsed.tool_calls
                ]
                message = {"role": "assistant", "content": turn.parsed.content or (None if tool_calls else "")}
                if tool_calls:
                    message["tool_calls"] = tool_calls
                choice = {"index": i, "message": message, "finish_reason": "tool_calls" if tool_calls else reason}
                if body.get("logprobs") is True:
                    choice["logprobs"] = {
                        "content": [
                            {"token": f"token_id:{t}", "logprob": lp} for t, lp in zip(tokens, logprobs, strict=True)
                        ]
                    }
                if ids:
                    choice["token_ids"] = tokens
            else:
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                choice = {"index": i, "text": text, "finish_reason": reason, "token_ids": tokens}
                if body.get("logprobs") is not None:
                    choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": logprobs}
            choices.append(choice)
            records.append(
                Call(
                    rid,
                    i,
                    trace_id,
                    owner_of(request.scope),
                    name,
                    revision.sampler_id or name,
                    "chat" if chat else "completion",
                    list(prompt),
                    list(tokens),
                    list(logprobs),
                    {**params, "n": n},
                    reason,
                    tool_calls,
                    user_id,
                    tag,
                )
            )
        out = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": name,
            "choices": choices,
            "usage": {
                "prompt_tokens": sum(len(p) for p in prompts) * n,
                "completion_tokens": sum(len(c[0]) for _, c in served_calls),
            },
        }
        if ids:
            out["prompt_token_ids"] = prompts[0] if chat else prompts
        if self.recorder is not None:
            await self.recorder.record(records)  # committed before the response goes out (or counted as failed)
            out["trace_id"] = trace_id
            response.headers["X-Trace-Id"] = trace_id
        return out

    # --- recording ------------------------------------------------------------------------
    async def _recorded_body(self, request: Request) -> dict:
        """A request's body, once its key's recorded traffic is under its budget (else 403 naming it)."""
        if self.recorder and (over := await self.recorder.over_budget(owner_of(request.scope))):
            raise BadRequest(over, 403)  # before the body is parsed or tokenized: a refusal costs little
        return await _body(request)

    async def health(self) -> dict:
        """Open to load balancers: counts only (the store and its last error: `GET /v1/recording`)."""
        if self.recorder is None:
            return {"status": "ok"}
        return {
            "status": "ok",
            "recording": {k: v for k, v in self.recorder.health().items() if k in ("recorded", "failed")},
        }

    async def recording(self) -> dict:
        if self.recorder is None:
            raise BadRequest("recording is off: start the server with --record STORE")
        return self.recorder.health()

    async def feedback(self, request: Request) -> dict:
        """`{"trace_id" or "response_id", "reward", "label"?, "comment"?}` on one of this key's traces."""
        if self.recorder is None:
            raise BadRequest("feedback needs recording: start the server with --record STORE", 400)
        body = await self._recorded_body(request)
        trace_id, response_id, reward = body.get("trace_id", ""), body.get("response_id", ""), body.get("reward")
        if not (isinstance(trace_id, str) and isinstance(response_id, str)) or bool(trace_id) == bool(response_id):
            raise BadRequest("feedback names one string field: trace_id or response_id")
        label, comment = (
            text_field(body.get("label", ""), "label", 256),
            text_field(body.get("comment", ""), "comment", 4096),
        )
        fb = Feedback(trace_id, owner_of(request.scope), reward, response_id, label, comment)
        try:
            await asyncio.to_thread(self.recorder.store.add_feedback, fb)
        except UnknownTrace as e:
            raise BadRequest(str(e), 404) from None
        except TooMuchFeedback as e:
            raise BadRequest(str(e), 429) from None
        except TraceError as e:
            raise BadRequest(str(e)) from None
        except Exception as e:  # noqa: BLE001 - the store is down: nothing was written, the client may retry
            raise BadRequest(f"the trace store cannot take feedback ({type(e).__name__}); retry later", 503) from None
        return {"status": "ok", "trace_id": fb.trace_id}


async def _body(request: Request) -> dict:
    return json_object(await request.body())


def _available_bytes(device: torch.device) -> int:
    """Memory still free where the adapters live, once the base is loaded."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    raise RuntimeError("no MemAvailable in /proc/meminfo: set --adapter-memory-mib")
