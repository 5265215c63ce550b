"""What a face's routes (`openai_routes`, `tinker_routes`) read of the `app.Server` they are
mounted on: its settings, the service, the worker every call waits on, and a learning server's
revisions."""

from __future__ import annotations

from typing import Protocol

from .config import ServeConfig
from .revisions import Revisions
from .tinker_service import TinkerService
from .tinker_types import SampleCall
from .worker import Worker


class Server(Protocol):
    cfg: ServeConfig
    service: TinkerService
    worker: Worker
    revisions: Revisions | None

    def sample(self, payloads: list[list[SampleCall]]) -> list: ...
