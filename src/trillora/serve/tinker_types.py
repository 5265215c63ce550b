"""The Tinker-compatible service's settings and records: what the HTTP layer hands the service
(`FwdBwd`, `SampleCall`) and what the service keeps (sessions, training clients)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import torch

from ..errors import TrilloraError
from ..policy.adapters import Adapter, Revision
from .wire import Datum

NAME = re.compile(
    r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}"
)  # fullmatch: never "." or "..", no newline; names become folders
MODEL_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._:-]{0,127}")


class BadRequest(TrilloraError):
    """A request the service refuses: the HTTP status and a message naming the culprit."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status

    def __reduce__(self):  # the status travels too (a pipeline's last stage sends outcomes to the others)
        return BadRequest, (str(self), self.status)


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
    batch: int | None = None
    """The calls of one request (an OpenAI completion's prompts) share one `generate` even when seeded."""
    options: dict = field(default_factory=dict)
    """Scores beyond the sampled tokens (`tinker_checks.sample_options`, `policy.logprobs.score_prompt`)."""


@dataclass
class Session:
    session_id: str
    owner: str = ""
    """The digest of the key that opened it (`http.owner_of`): what it holds counts against that key's share."""
    models: dict[str, Client] = field(default_factory=dict)
    samplers: dict[str, Revision] = field(default_factory=dict)
    ephemeral: set[str] = field(default_factory=set)
    """Its samplers made from unnamed revisions (the first to go when samplers run out)."""
    seen: float = field(default_factory=time.monotonic)
    """When the session was last heard from (a heartbeat or any call naming it)."""
