"""`trillora serve`'s settings: one resident base, the faces it serves and the bounds it keeps."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, fields
from typing import Literal, get_args

from ..lora.config import EXPERT_RANK_RULES, ExpertRankRule
from ..parallel.dims import ParallelDims
from .calls import BadRequest
from .http import Limits

BUDGETS = (
    "max_connections",
    "idle_seconds",
    "header_seconds",
    "body_seconds",
    "max_body_bytes",
    "max_prompts",
    "max_samples",
    "max_tokens_limit",
    "max_call_tokens",
    "max_fused",
    "kept_kv_tokens",
    "adapter_memory_mib",
    "max_trace_rows",
    "max_trace_mib",
    "max_sessions",
    "max_clients",
    "max_samplers",
    "max_rank",
    "max_futures",
    "max_unread_mib",
    "max_state_gib",
    "max_metadata_kib",
    "session_seconds",
)
"""What a client, or a key, can make the server keep or spend (memory, disk, slots, time): the fields
the docs' budget tables list (docs/product-loop.md and docs/tinker.md, generated from these)."""
ServePrecision = Literal["fp32", "bf16", "bf16_weights"]
PRECISIONS: tuple[str, ...] = get_args(ServePrecision)


@dataclass
class ServeConfig:
    """`trillora serve`'s flags are these fields (`cli.flags`): `max_fused` is `--max-fused`."""

    model: str
    """A shipped model (tiny-moe, tiny-moe-chat), a Hugging Face checkpoint folder or a Hub id."""
    tinker: bool = False
    """Serve the Tinker routes (training clients) beside the OpenAI ones, on the same port and base."""
    host: str = "127.0.0.1"
    """Where to listen; anything but loopback serves other machines (give --api-key then)."""
    port: int = 8000
    """0: any free port (printed at start)."""
    api_key: str | list[str] | None = None
    """Required on every route but the health checks: `Authorization: Bearer KEY` or `X-API-Key: KEY`.
    Several keys: any of them is let in, and each key's recorded traffic is its own (`--record`);
    the first is the operator's, the only one that may load and unload adapters or roll back."""
    record: str | None = None
    """Record every OpenAI completion (token ids, logprobs, revision) in this trace store: a SQLite
    file, or a `postgresql://` URL (`traces.store`). None: nothing is recorded."""
    max_trace_rows: int = 1_000_000
    """With --record: each key's recorded traffic holds at most this many choices; past it the key's
    completions and feedback are refused (403) until the operator deletes some (`trillora traces delete`)."""
    max_trace_mib: float = 1024.0
    """With --record: each key's recorded traffic (prompts, settings, completions, logprobs, feedback)
    holds at most this much text; past it the same 403."""
    state_dir: str = "tinker-state"
    """Saved states and sampler weights live here, as tinker://<model_id>/<kind>/<name>."""
    adapter_root: str | None = None
    """OpenAI `load_lora_adapter` reads adapters only from inside this folder; None disables loading."""
    adapter_memory_mib: float | None = None
    """Served adapters (OpenAI `load_lora_adapter`) hold at most this much together (each is its
    tensors only, not a copy of the base); None: half the memory free once the base is loaded."""
    max_body_bytes: int | None = None
    """Request bodies; None: 64 MiB on the Tinker routes (datums of long traces), 1 MiB on the OpenAI ones."""
    max_rank: int = 256
    """The largest LoRA rank a Tinker training client may ask for."""
    max_samples: int = 64
    """Samples per prompt (Tinker num_samples, OpenAI n)."""
    max_prompts: int = 64
    """Prompts in one OpenAI /v1/completions request."""
    max_tokens_limit: int = 4096
    """The largest `max_tokens` of one request."""
    max_call_tokens: int = 65536
    """Tokens one call may hold: a forward_backward's datums together, or a sample request's
    n × (prompt + max_tokens). Each call's time is bounded by it, and the worker runs calls in
    arrival order, so a client waits at most for the calls that arrived before its own."""
    max_clients: int = 16
    """Tinker training clients held at once."""
    max_samplers: int = 256
    """Sampling sessions (saved revisions) held at once, over all Tinker sessions."""
    max_sessions: int = 256
    """Tinker sessions held at once. With several keys each key holds at most its even share of the
    sessions, clients and samplers."""
    max_futures: int = 1024
    """Tinker requests one key may hold queued or not yet retrieved; past it 429 (the SDK waits and retries)."""
    max_unread_mib: int = 1024
    """A key's results not yet retrieved hold at most this much; past it its oldest are dropped (410)."""
    max_state_gib: float = 64.0
    """Saved states under `state_dir`, with the runs' records and their user metadata, hold at most this
    much; past it a save, or a run record with metadata, is refused (403)."""
    max_metadata_kib: int = 16
    """A run's or a saved state's `user_metadata` (as JSON) holds at most this much; more is refused (400)."""
    session_seconds: float = 300.0
    """A Tinker session not heard from (heartbeat or any call) for this long is ended and its training
    clients and samplers freed (the SDK beats every 10 s)."""
    lora_alpha: float = 16.0
    """LoRA alpha of every adapter on the resident base (an adapter of rank r scales B·A by alpha / r)."""
    device: str = "cpu"
    """Where the base and the adapters live: cpu, cuda."""
    precision: ServePrecision = "fp32"
    """The resident base's weights: fp32, bf16, or bf16_weights (rounded to bf16, computed in fp32:
    a bf16 engine's numerics at fp32 speed on a CPU). Adapters and their optimizer stay fp32."""
    poll_seconds: float = 20.0
    """How long retrieve_future holds a pending request before answering try_again."""
    max_connections: int = 512
    """Connections open at once. When all are taken, a new one takes the slot of the oldest waiting
    connection that has not passed the key check; only when there is none is it answered 503."""
    idle_seconds: float = 60.0
    """A connection may wait this long before (or between) requests (`header_seconds` until one of its
    requests has passed the key check)."""
    header_seconds: float = 10.0
    """From a request's first byte to the end of its headers."""
    body_seconds: float = 60.0
    """For a request's whole body."""
    kept_kv_tokens: int = 16384
    """The keys and values of the last decode stay for a chat's next call (which then prefills only its
    new turn) when they hold at most this many tokens (rows × length); 0: never kept."""
    max_fused: int = 16
    """At most this many waiting requests (of one or several clients) share one pass; 1: never."""
    gather_seconds: float = 0.01
    """How long a lone request may wait for other clients' to share its pass (only while others are active)."""
    trust_remote_code: bool = False
    """Let the tokenizer run its own Python code (Kimi K2's tiktoken tokenizer)."""
    parallel: ParallelDims = field(default_factory=lambda: ParallelDims(dp=0))
    """Under torchrun, the base's layout (`parallel.ParallelDims`, the trainer's: its flags are its
    fields, `--tp 2 --ep 2`): layers over tp, experts over ep, stages over pp (`pp_microbatches`
    chunks of a pass in flight, 0 = one per stage), rows of a training pass over cp, and the rest
    of the ranks data-parallel, the frozen base sharded over them (`fsdp`, gathered layer by layer
    for every pass; the clients' adapters stay whole on every rank)."""
    expert_rank_rule: ExpertRankRule = "same"
    """Rank of each client's routed-expert adapters: `same` as its rank, or `divide_by_top_k` (rank //
    top_k, at least 1: a token's k experts add up to about one rank-r update, at 1/k of the bytes)."""

    def __post_init__(self) -> None:
        for key in ("vocab_parallel", "sp"):  # the degrees themselves: ParallelDims checks them
            if getattr(self.parallel, key) and self.parallel.tp < 2:
                raise BadRequest(f"{key} splits over the tensor-parallel ranks; it needs tp >= 2")
        if self.expert_rank_rule not in EXPERT_RANK_RULES:
            raise BadRequest(f"expert_rank_rule={self.expert_rank_rule!r}; allowed: {', '.join(EXPERT_RANK_RULES)}")
        if not isinstance(self.max_fused, int) or self.max_fused < 1:
            raise BadRequest(f"max_fused={self.max_fused!r}; allowed: an integer >= 1 (1: every request alone)")
        if type(self.kept_kv_tokens) is not int or self.kept_kv_tokens < 0:
            raise BadRequest(f"kept_kv_tokens={self.kept_kv_tokens!r}; allowed: an integer >= 0 (0: never kept)")
        if not 0 <= self.gather_seconds <= 1:
            raise BadRequest(f"gather_seconds={self.gather_seconds!r}; allowed: 0..1")
        if self.precision not in PRECISIONS:
            raise BadRequest(f"precision {self.precision!r}; allowed: {', '.join(PRECISIONS)}")
        for key in (f.name for f in fields(self) if f.name.startswith("max_") and f.type == "int"):  # counts
            if type(getattr(self, key)) is not int or getattr(self, key) < 1:
                raise BadRequest(f"{key}={getattr(self, key)!r}; allowed: an integer >= 1")
        keys = [self.api_key] if isinstance(self.api_key, str) else self.api_key
        if keys is not None and (not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys)):
            raise BadRequest("api_key: a non-empty string, or a list of them")
        for key, unit in (("max_state_gib", "GiB"), ("max_trace_mib", "MiB")):
            size = getattr(self, key)
            if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size < float("inf"):
                raise BadRequest(f"{key}={size!r}; allowed: a finite number of {unit} > 0")
        mib = self.adapter_memory_mib
        if mib is not None and (not isinstance(mib, (int, float)) or not 0 <= mib < float("inf")):
            raise BadRequest(f"adapter_memory_mib={mib!r}; allowed: a finite number of MiB >= 0 (or unset)")
        for key in ("idle_seconds", "header_seconds", "body_seconds", "poll_seconds", "session_seconds"):
            if not getattr(self, key) > 0:
                raise BadRequest(f"{key}={getattr(self, key)!r}; allowed: a number of seconds > 0")

    def key_count(self) -> int:
        return 1 if isinstance(self.api_key, str) else len(self.api_key or [])

    def operator(self) -> str | None:
        """The digest (`http.owner_of`) of the operator's key when several keys are given, else None."""
        if not isinstance(self.api_key, list) or len(self.api_key) < 2:
            return None
        return hashlib.sha256(self.api_key[0].encode()).hexdigest()[:16]

    def limits(self) -> Limits:
        keys = [self.api_key] if isinstance(self.api_key, str) else list(self.api_key or [])
        return Limits(
            api_keys=tuple(keys),
            max_body_bytes=self.max_body_bytes or 1 << 20,
            max_tinker_body_bytes=self.max_body_bytes or 64 << 20,
            max_connections=self.max_connections,
            idle_seconds=self.idle_seconds,
            header_seconds=self.header_seconds,
            body_seconds=self.body_seconds,
        )
