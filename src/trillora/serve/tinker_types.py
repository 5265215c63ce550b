"""The Tinker-compatible service's settings and records: what the HTTP layer hands the service
(`FwdBwd`, `SampleCall`) and what the service keeps (sessions, training clients)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..errors import TrilloraError
from ..lora.config import EXPERT_RANK_RULES
from .adapters import Adapter, Revision
from .wire import Datum

NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")  # never "." or "..": names become folders
MODEL_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._:-]{0,127}$")


class BadRequest(TrilloraError):
    """A request the service refuses: the HTTP status and a message naming the culprit."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status

    def __reduce__(self):  # the status travels too (a pipeline's last stage sends outcomes to the others)
        return BadRequest, (str(self), self.status)


@dataclass
class TinkerConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    state_dir: str = "tinker-state"
    """Saved states and sampler weights live here, as tinker://<model_id>/<kind>/<name>."""
    max_body_bytes: int = 64 << 20
    max_rank: int = 256
    max_samples: int = 64
    max_tokens_limit: int = 4096
    max_clients: int = 16
    lora_alpha: float = 16.0
    device: str = "cpu"
    precision: str = "fp32"
    """The resident base's weights: fp32, or bf16 (adapters and their optimizer stay fp32)."""
    poll_seconds: float = 20.0
    """How long retrieve_future holds a pending request before answering try_again."""
    max_connections: int = 64
    idle_seconds: float = 60.0
    max_fused: int = 16
    """At most this many waiting requests (of one or several clients) share one pass; 1: never."""
    gather_seconds: float = 0.01
    """How long a lone request may wait for other clients' to share its pass (only while others are active)."""
    trust_remote_code: bool = False
    """Let the tokenizer run its own Python code (Kimi K2's tiktoken tokenizer)."""
    tp: int = 1
    """Under torchrun: split attention and dense MLP layers over groups of this many ranks (`serve.tinker_sharded`)."""
    ep: int = 1
    """Under torchrun: shard the routed experts over groups of this many ranks (`serve.tinker_sharded`)."""
    pp: int = 1
    """Under torchrun: split the decoder layers into this many pipeline stages (`parallel.staged`)."""
    cp: int = 1
    """Under torchrun: split each row of a forward_backward pass over this many ranks (context
    parallelism: long traces at 1/cp of the activations per rank); sampling decodes whole rows."""
    fsdp: bool = False
    """Under torchrun: shard the frozen base over the data-parallel ranks (FSDP2), each layer gathered
    for every pass; the clients' adapters stay whole on every rank."""
    sp: bool = False
    """Under --tp: sequence parallelism, the norms and the residual stream between blocks split over
    the sequence (a tp-th of those activations per rank)."""
    vocab_parallel: bool = False
    """Under --tp: the head split over the vocabulary; losses read logprobs without the full logits."""
    pp_microbatches: int = 1
    """Under --pp: a forward_backward pass's rows in this many chunks in flight one after another, so
    the stages overlap (1: the whole pass at once, the stages in turn)."""
    expert_rank_rule: str = "same"
    """Rank of each client's routed-expert adapters: `same` as its rank, or `divide_by_top_k` (rank //
    top_k, at least 1: a token's k experts add up to about one rank-r update, at 1/k of the bytes)."""
    activation_checkpoint_every: int = 0
    """Recompute every k-th decoder layer in backward instead of keeping its activations (0 = off)."""

    def __post_init__(self) -> None:
        for key in ("tp", "ep", "pp", "cp", "pp_microbatches"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                why = "" if key == "pp_microbatches" else " dividing the number of ranks"
                raise BadRequest(f"{key}={getattr(self, key)!r}; allowed: an integer >= 1{why}")
        for key in ("vocab_parallel", "sp"):
            if getattr(self, key) and self.tp < 2:
                raise BadRequest(f"{key} splits over the tensor-parallel ranks; it needs tp >= 2")
        if not isinstance(self.activation_checkpoint_every, int) or self.activation_checkpoint_every < 0:
            raise BadRequest(f"activation_checkpoint_every={self.activation_checkpoint_every!r}; allowed: an integer "
                             ">= 0 (0 = off, 1 = every layer)")
        if self.expert_rank_rule not in EXPERT_RANK_RULES:
            raise BadRequest(f"expert_rank_rule={self.expert_rank_rule!r}; allowed: {', '.join(EXPERT_RANK_RULES)}")
        if not isinstance(self.max_fused, int) or self.max_fused < 1:
            raise BadRequest(f"max_fused={self.max_fused!r}; allowed: an integer >= 1 (1: every request alone)")
        if not 0 <= self.gather_seconds <= 1:
            raise BadRequest(f"gather_seconds={self.gather_seconds!r}; allowed: 0..1")


@dataclass
class Client:
    model_id: str
    adapter: Adapter
    rank: int
    roles: tuple[str, ...]


@dataclass
class FwdBwd:
    """One forward_backward (or forward) call, its data checked by `check_data`."""

    model_id: str
    loss_fn: str
    config: dict
    data: list[Datum]
    tensors: list[dict[str, torch.Tensor]]
    forward_only: bool


@dataclass
class SampleCall:
    sampler_id: str
    prompt: list[int]
    n: int
    params: dict
    prompt_logprobs: bool = False


@dataclass
class Session:
    session_id: str
    models: dict[str, Client] = field(default_factory=dict)
    samplers: dict[str, Revision] = field(default_factory=dict)
