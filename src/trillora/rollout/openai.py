"""`OpenAIEngine`: rollouts from OpenAI-compatible completion servers (vLLM, SGLang, `trillora serve`).

Prompts go as token ids, n samples per request, with per-token logprobs and the sampled
token ids (`return_tokens_as_token_ids`), so nothing is re-tokenised. Requests run in a
bounded thread pool spread round-robin over the servers, with a timeout and retries with
exponential back-off. `sync()` is adapter-only by default: it saves the adapter under a new
revision name (`{model}-{run tag}-r{n}`), asks every server to load it (`/v1/load_lora_adapter`) and unloads the
previous revision. `sync="merged"` is for vLLM servers that cannot apply the adapter (MoE on
CPU): the merged tensors the adapter changes go to a safetensors file that every server
loads through `/collective_rpc` (a server started with `VLLM_SERVER_DEV_MODE=1`, `TRILLORA_SYNC_DIR` and
`--worker-extension-cls trillora.rollout.vllm_sync.WeightSyncExtension`), then its prefix
cache is reset.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import secrets
import shutil
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch import nn

from ..errors import TrilloraError
from .types import Completion, SamplingParams


class EngineError(TrilloraError, RuntimeError):
    """A server that keeps failing; the message names the URL and the last error."""


def _body(raw: bytes) -> dict:
    """JSON answers as dicts; vLLM answers some admin endpoints with plain text or nothing."""
    try:
        return json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        return {"text": raw.decode(errors="replace")}


class OpenAIEngine:
    returns_routing = False  # the OpenAI API has no field for the routed experts

    def __init__(
        self,
        urls: list[str] | str,
        model: str,
        sync_dir: str | Path | None = None,
        api_key: str | None = None,
        concurrency: int = 8,
        timeout: float = 120.0,
        retries: int = 3,
        backoff: float = 0.5,
        sync: str = "adapter",
        keep_revisions: int = 1,
    ):
        if sync not in ("adapter", "merged"):
            raise ValueError(f"OpenAIEngine sync {sync!r}; allowed: 'adapter', 'merged'")
        self.sync_mode = sync
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        if not self.urls:
            raise ValueError("OpenAIEngine needs at least one server URL")
        self.base_model, self.model = model, model
        self.sync_dir = Path(sync_dir) if sync_dir is not None else None
        self.api_key, self.timeout, self.retries, self.backoff = api_key, timeout, retries, backoff
        self.pool = ThreadPoolExecutor(max_workers=concurrency)
        self._next_url = itertools.cycle(self.urls)
        self.revision = 0
        self.tag = secrets.token_hex(3)  # revision names stay unique when several runs share a server
        self.keep_revisions = keep_revisions
        """Adapter revisions left loaded on the servers after a sync: more than one lets a batch that
        started sampling before the sync finish on its own revision (asynchronous rollouts)."""
        self.loaded: list[str] = []  # adapter revisions loaded on the servers, oldest first

    # --- HTTP ----------------------------------------------------------------------------
    def _post(self, url: str, path: str, body: dict, retries: int | None = None, timeout: float | None = None) -> dict:
        retries = self.retries if retries is None else retries
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last: Exception | None = None
        for attempt in range(retries + 1):
            try:
                req = urllib.request.Request(url + path, data=data, headers=headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout if timeout is None else timeout) as resp:
                    return _body(resp.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:500]
                if e.code < 500 and e.code != 429:  # the request itself is wrong: retrying will not help
                    raise EngineError(f"{url}{path}: HTTP {e.code}: {detail}") from None
                last = EngineError(f"HTTP {e.code}: {detail}")
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = e
            if attempt < retries:
                time.sleep(self.backoff * 2**attempt)
        raise EngineError(f"{url}{path}: failed after {retries + 1} attempts: {last}")

    # --- protocol ------------------------------------------------------------------------
    def _one(self, prompt: list[int], n: int, params: SamplingParams, url: str, model: str) -> list[Completion]:
        body = {
            "model": model,
            "prompt": prompt,
            "n": n,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "stop_token_ids": list(params.stop_token_ids),
            "skip_special_tokens": False,
        }
        if params.top_k:
            body["top_k"] = params.top_k
        if params.seed is not None:
            body["seed"] = params.seed
        out = self._post(url, "/v1/completions", body)
        completions = []
        for choice in sorted(out["choices"], key=lambda c: c["index"]):
            lp = choice.get("logprobs") or {}
            tokens = choice.get("token_ids") or [int(t.removeprefix("token_id:")) for t in lp.get("tokens", [])]
            logprobs = [float(x) for x in lp.get("token_logprobs", [])]
            if len(logprobs) != len(tokens):
                raise EngineError(f"{url}: {len(tokens)} tokens but {len(logprobs)} logprobs in a completion")
            stopped = choice.get("finish_reason") == "stop"
            completions.append(
                Completion(
                    prompt_ids=list(prompt),
                    token_ids=tokens,
                    logprobs=logprobs,
                    finish_reason="stop" if stopped else "length",
                )
            )
        return completions

    def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, model: str | None = None
    ) -> list[list[Completion]]:
        """Without a seed: one request of n samples per prompt. With a seed: n requests of one sample, seeds
        seed + i·n + j, because vLLM gives every sample of a seeded n>1 request the same tokens. Every
        request of the call names the same model (the revision current when it began, or `model`)."""
        model = model or self.model
        jobs = [
            [self.pool.submit(self._one, p, k, call, next(self._next_url), model) for p, k, call in requests]
            for requests in params.requests(prompts, n)
        ]
        return [[c for f in fs for c in f.result()] for fs in jobs]

    def pinned(self):
        """A view that samples from the current revision even if a sync loads a newer one meanwhile
        (adapter sync keeping `keep_revisions` > 1); None when the engine cannot do that."""
        if self.sync_mode != "adapter" or self.keep_revisions < 2:
            return None
        model = self.model
        return lambda prompts, n, params: self.generate(prompts, n, params, model=model)

    def sync(self, model: nn.Module) -> dict[str, float]:
        """Adapter-only sync: a new revision loaded by every server, the previous one unloaded."""
        from ..lora import save_adapter
        from ..lora.export import vllm_layout

        if self.sync_dir is None:
            raise ValueError("OpenAIEngine.sync needs sync_dir: a folder the servers can read adapters from")
        start = time.perf_counter()
        self.revision += 1
        if self.sync_mode == "merged":
            return self._sync_merged(model, start)
        name = f"{self.base_model}-{self.tag}-r{self.revision}"
        path = save_adapter(model, self.sync_dir / name, expert_layout=vllm_layout(model), base_model=self.base_model)
        for url in self.urls:
            self._post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path.resolve())})
        self.model = name
        self.loaded.append(name)
        size = sum(f.stat().st_size for f in path.iterdir())
        while len(self.loaded) > self.keep_revisions:  # the oldest revisions no batch samples from any more
            old = self.loaded.pop(0)
            for url in self.urls:
                self._post(url, "/v1/unload_lora_adapter", {"lora_name": old})
            shutil.rmtree(self.sync_dir / old, ignore_errors=True)
        return {"sync_bytes": float(size), "sync_seconds": time.perf_counter() - start}

    def _sync_merged(self, model: nn.Module, start: float) -> dict[str, float]:
        from safetensors.torch import save_file

        from .vllm_sync import merged_tensors

        self.sync_dir.mkdir(parents=True, exist_ok=True)
        path = self.sync_dir / f"merged-r{self.revision}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file(merged_tensors(model), str(tmp))
        tmp.replace(path)  # servers never read a half-written file
        try:
            for url in self.urls:
                out = self._post(
                    url, "/collective_rpc", {"method": "trillora_load_merged", "args": [str(path.resolve())]}
                )
                refused = [r for r in (out or {}).get("results", []) if str(r).startswith("refused:")]
                if refused:
                    raise EngineError(f"{url}/collective_rpc: {refused[0]}")
                self._post(url, "/reset_prefix_cache", {})
            return {"sync_bytes": float(path.stat().st_size), "sync_seconds": time.perf_counter() - start}
        finally:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        """Unload this run's adapter revisions from the servers (once each, best effort: a server
        holds a bounded number, and runs sharing one should not fill it), then stop the pool."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        for name in self.loaded:
            for url in self.urls:
                with contextlib.suppress(EngineError):  # gone or never loaded there: nothing left to free
                    self._post(url, "/v1/unload_lora_adapter", {"lora_name": name}, retries=0, timeout=5.0)
        self.loaded = []
