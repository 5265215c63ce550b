"""What a face's routes (`openai/`, `tinker/`) read of the `app.Server` they are mounted on: its
settings, the resident service, the worker every call waits on, and a learning server's
revisions. The OpenAI face and the revisions read the service through `Service`, the part every
face shares (the Tinker face holds the whole service it was given)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from ..policy.adapters import ResidentBase, Revision
from .calls import SampleCall
from .config import ServeConfig
from .registry import Registry
from .revisions import Revisions
from .worker import Worker


class Service(Protocol):
    cfg: ServeConfig
    path: Path
    tokenizer: object
    base: ResidentBase
    device: torch.device
    registry: Registry

    def served(self) -> dict[str, Revision]: ...
    def serve_adapter(self, name: str, revision: Revision) -> None: ...
    def unserve_adapter(self, name: str) -> None: ...


class Server(Protocol):
    cfg: ServeConfig
    service: Service
    worker: Worker
    revisions: Revisions | None

    def sample(self, payloads: list[list[SampleCall]]) -> list: ...
