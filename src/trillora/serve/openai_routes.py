"""`trillora serve MODEL`: the OpenAI routes on the resident base.

The subset of vLLM's server that RL clients use: `/v1/completions` with token-id prompts, n
samples and per-token logprobs (tokens as `token_id:N`, as vLLM's `return_tokens_as_token_ids`),
`/v1/chat/completions`, `/v1/models`, the dynamic LoRA routes `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`, and `/health`.

A loaded adapter is a revision in the base's adapter slots (its tensors only, never a copy of the
base), so how many fit is a matter of memory (`adapter_memory_mib`, reported in /v1/models). A
request's prompts wait on the service's worker like the Tinker samples do: requests for different
adapters that wait together are sampled in one pass, each row with its own adapter.
"""

from __future__ import annotations

import itertools
import re
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from fastapi import APIRouter, Request

from ..lora import AdapterError
from ..rollout.types import SamplingParams
from .http import json_object
from .tinker_service import BadRequest, SampleCall
from .worker import outcome_of

if TYPE_CHECKING:
    from .app import Server

NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "trillora_adapter.json")


class OpenAIRoutes:
    def __init__(self, server: Server):
        self.server, self.cfg, self.service = server, server.cfg, server.service
        self.tokenizer = self.service.tokenizer
        self.max_len = self.service.base.model.args.max_position_embeddings
        self.base_bytes = sum(p.numel() * p.element_size() for n, p in self.service.base.model.named_parameters()
                              if ".lora_" not in n)
        self.adapter_limit = (_available_bytes(self.service.device) // 2 if self.cfg.adapter_memory_mib is None
                              else int(self.cfg.adapter_memory_mib * (1 << 20)))
        self.requests = itertools.count()
        r = self.router = APIRouter()
        r.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
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
            path = (root / given).resolve()  # an absolute `given` replaces the root
            files = [(path / f).resolve() for f in ADAPTER_FILES if (path / f).exists()]
        except (OSError, RuntimeError, ValueError) as e:  # too long, a link loop, a NUL byte
            raise BadRequest(f"lora_path {given!r} cannot be read: {type(e).__name__}") from None
        if any(root != p and root not in p.parents for p in [path, *files]):
            raise BadRequest(f"lora_path {given!r} is outside the adapter root", 403)
        if not (path / "adapter_config.json").exists():
            raise BadRequest(f"no adapter at {given!r}", 404)
        return path

    async def load_adapter(self, request: Request) -> dict:
        body = await _body(request)
        name, given = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not NAME.fullmatch(name) or not isinstance(given, str):
            raise BadRequest("load_lora_adapter needs string fields lora_name (1-128 letters, digits, '.', '_', ':', '/' "
                             "or '-') and lora_path")
        if name == self.cfg.model:
            raise BadRequest(f"lora_name {name!r} is the base model's name")
        path = self._adapter_path(given)
        await outcome_of(self.server.worker, lambda: self._load(name, path))  # on the worker: it fills the slots
        return {"status": "ok", "lora_name": name}

    def _load(self, name: str, path: Path) -> None:
        try:
            revision = self.service.base.revision_from_folder(path)
        except (AdapterError, ValueError) as e:
            raise BadRequest(str(e)) from None
        room = self.adapter_limit - sum(r.bytes() for n, r in self.service.served().items() if n != name)  # a replaced name frees its bytes
        if revision.bytes() > room:
            raise BadRequest(f"adapter {name!r} holds {revision.bytes() / 2**20:.1f} MiB; {max(room, 0) / 2**20:.1f} MiB of the "
                             "adapter memory is free (--adapter-memory-mib): unload one first")  # 400: retrying cannot help
        self.service.serve_adapter(name, revision)

    async def unload_adapter(self, request: Request) -> dict:
        name = (await _body(request)).get("lora_name")
        if not isinstance(name, str):
            raise BadRequest("unload_lora_adapter needs a string field lora_name")
        self.service.unserve_adapter(name)
        return {"status": "ok", "lora_name": name}

    async def models(self) -> dict:
        served = self.service.served()
        held = {n: r.bytes() for n, r in served.items()}
        return {"object": "list",
                "data": [{"id": n, "object": "model", "owned_by": "trillora", "parent": None if n == self.cfg.model else self.cfg.model,
                          "max_model_len": self.max_len, "adapter_bytes": held[n]} for n in served],
                "adapter_memory": {"base_bytes": self.base_bytes, "held_bytes": sum(held.values()),
                                   "limit_bytes": self.adapter_limit}}

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
            if isinstance(p, str) and len(p) > 64 * self.max_len:  # bounded before the tokenizer runs on the event loop
                raise BadRequest(f"a prompt of {len(p)} characters is longer than the model's {self.max_len} positions can hold")
            if isinstance(p, str):
                out.append(self.tokenizer(p, add_special_tokens=False)["input_ids"])
            elif isinstance(p, list) and p and all(isinstance(t, int) and 0 <= t < len(self.tokenizer) for t in p):
                out.append(p)
            else:
                raise BadRequest("each prompt must be a non-empty string or list of valid token ids")
        return out

    def _chat_prompt(self, messages) -> list[list[int]]:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest("this model's tokenizer has no chat template")
        try:  # text, then ids: tokenize=True gives a BatchEncoding in transformers 5
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a malformed message: the template's own error  # noqa: BLE001
            raise BadRequest(f"messages do not fit the chat template: {e}") from None
        return [self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def _params(self, body: dict) -> tuple[dict, int]:
        """The sampling settings as the service takes them (Tinker's names), checked with OpenAI's."""
        n, max_tokens, seed = body.get("n", 1), body.get("max_tokens", 16), body.get("seed")
        if not isinstance(n, int) or not 1 <= n <= self.cfg.max_samples:
            raise BadRequest(f"n must be an integer in 1..{self.cfg.max_samples}")
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= self.cfg.max_tokens_limit:
            raise BadRequest(f"max_tokens must be an integer in 1..{self.cfg.max_tokens_limit}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise BadRequest(f"seed must be an integer, not {type(seed).__name__}")
        stop = body.get("stop_token_ids") or []
        if not isinstance(stop, list) or not all(isinstance(t, int) and 0 <= t < len(self.tokenizer) for t in stop):
            raise BadRequest(f"stop_token_ids must be a list of token ids in 0..{len(self.tokenizer) - 1}")
        if self.tokenizer.eos_token_id is not None and not body.get("ignore_eos", False):
            stop = stop + [self.tokenizer.eos_token_id]
        if seed is not None and not 0 <= seed < 2**63:
            raise BadRequest(f"seed must be in 0..2**63-1, not {seed}")
        try:
            params = {"max_tokens": max_tokens, "temperature": float(body.get("temperature", 1.0)),
                      "top_p": float(body.get("top_p", 1.0)), "top_k": max(0, int(body.get("top_k", 0) or 0)),
                      "seed": seed, "stop": stop}
            SamplingParams(max_new_tokens=max_tokens, temperature=params["temperature"], top_p=params["top_p"],
                           top_k=params["top_k"], seed=seed)
        except (TypeError, ValueError, OverflowError) as e:
            raise BadRequest(str(e)) from None
        return params, n

    async def completions(self, request: Request) -> dict:
        body = await _body(request)
        return await self._complete(body, self._prompts(body.get("prompt")), chat=False)

    async def chat_completions(self, request: Request) -> dict:
        body = await _body(request)
        return await self._complete(body, self._chat_prompt(body.get("messages")), chat=True)

    async def _complete(self, body: dict, prompts: list[list[int]], chat: bool) -> dict:
        params, n = self._params(body)
        for p in prompts:
            if len(p) + params["max_tokens"] > self.max_len:
                raise BadRequest(f"a prompt of {len(p)} tokens plus max_tokens={params['max_tokens']} "
                                 f"is over the model's {self.max_len} positions")
        total = n * sum(len(p) + params["max_tokens"] for p in prompts)
        if total > self.cfg.max_call_tokens:  # the request's time on the engine is bounded by it
            raise BadRequest(f"n={n} × {len(prompts)} prompts × (prompt + max_tokens={params['max_tokens']}) is {total} "
                             f"tokens; at most {self.cfg.max_call_tokens} per request (--max-call-tokens)")
        name, served = body.get("model") or self.cfg.model, self.service.served()
        if name not in served:
            raise BadRequest(f"model {name!r} is not loaded; loaded: {', '.join(served)}", 404)
        batch = next(self.requests)
        calls = [SampleCall(served[name].sampler_id, p, n, params, batch=batch) for p in prompts]
        try:
            outcomes = await outcome_of(self.server.worker, lambda: self.server.sample([calls])[0], fuse="sample", payload=calls)
        except BadRequest as e:
            if e.status == 404:  # unloaded while the request waited
                raise BadRequest(f"model {name!r} is not loaded", 404) from None
            raise
        choices = []
        for i, (tokens, logprobs, reason) in enumerate(c for completions, *_ in outcomes for c in completions):
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason})
                continue
            choice = {"index": i, "text": text, "finish_reason": reason, "token_ids": tokens}
            if body.get("logprobs") is not None:
                choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": logprobs}
            choices.append(choice)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": name, "choices": choices,
                "usage": {"prompt_tokens": sum(len(p) for p in prompts) * n,
                          "completion_tokens": sum(len(c[0]) for completions, *_ in outcomes for c in completions)}}


async def _body(request: Request) -> dict:
    return json_object(await request.body())


def _available_bytes(device: torch.device) -> int:
    """Memory still free where the adapters live, once the base is loaded."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no MemAvailable in /proc/meminfo: set --adapter-memory-mib")
