"""`trillora serve MODEL [--tinker]`: one resident service, its worker, and its faces on one port.

The OpenAI routes are always there; `--tinker` adds the Tinker routes beside them. Both reach the
model only through the one worker (`serve.worker`), so a Tinker client's samples and an OpenAI
client's completions that wait together share one pass, each row with its own adapter.
"""

from __future__ import annotations

import threading

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from .calls import BadRequest, SampleCall
from .config import ServeConfig
from .http import Listener, error_body
from .openai.routes import OpenAIRoutes
from .tinker.routes import TinkerRoutes
from .tinker.service import TinkerService
from .worker import Worker


class Server:
    def __init__(self, cfg: ServeConfig, service: TinkerService | None = None):
        self.cfg = cfg
        self.service = service or TinkerService(cfg)
        self.worker = Worker(
            {"forward_backward": self.service.forward_backward_many, "sample": self.sample},
            max_fused=cfg.max_fused,
            gather_seconds=cfg.gather_seconds,
        )
        self.app = FastAPI(title="trillora", docs_url=None, redoc_url=None, openapi_url=None)
        for kind, handler in (
            (HTTPException, _http_error),
            (BadRequest, _bad_request),
            ((TypeError, ValueError, KeyError, AttributeError), _malformed),
            (Exception, _server_error),
        ):
            for k in kind if isinstance(kind, tuple) else (kind,):
                self.app.add_exception_handler(k, handler)
        self.openai = OpenAIRoutes(self)
        self.app.include_router(self.openai.router)
        self.tinker = TinkerRoutes(self) if cfg.tinker else None
        if self.tinker is not None:
            self.app.include_router(self.tinker.router)
        self.revisions = None
        """A learning server's revisions and learner (`serve.revisions`, attached by `--learn`)."""
        self.listener = Listener(self.app, cfg.host, cfg.port, cfg.limits())
        cfg.port = self.listener.port  # port 0 asked for any free one: clients read it here

    def sample(self, payloads: list[list[SampleCall]]) -> list:
        """The worker's sample fuser: each payload's calls (a Tinker asample, an OpenAI request's
        prompts) in one `sample_many`; each payload's outcomes, or the first error among them."""
        flat = self.service.sample_many([c for p in payloads for c in p])
        out, start = [], 0
        for p in payloads:
            mine, start = flat[start : start + len(p)], start + len(p)
            out.append(next((o for o in mine if isinstance(o, Exception)), mine))
        return out

    def run(self, ready: threading.Event | None = None) -> None:
        faces = "OpenAI + Tinker routes" if self.tinker is not None else "OpenAI routes"
        print(f"trillora serve: {self.cfg.model} ({faces}) on http://{self.cfg.host}:{self.cfg.port}", flush=True)
        self.listener.run(ready)

    def stop(self) -> None:
        if self.revisions is not None:
            self.revisions.stop()
        self.listener.stop()


def _answer(request: Request, status: int, message: str) -> Response:
    return Response(error_body(request.url.path, status, message), status_code=status, media_type="application/json")


async def _http_error(request: Request, e: HTTPException) -> Response:
    message = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
    return _answer(request, e.status_code, message)


async def _bad_request(request: Request, e: BadRequest) -> Response:
    return _answer(request, e.status, str(e))


async def _malformed(request: Request, e: Exception) -> Response:  # a field of a type no check foresaw
    return _answer(request, 400, f"malformed request: {type(e).__name__}: {e}")


async def _server_error(request: Request, e: Exception) -> Response:
    return _answer(request, 500, f"{type(e).__name__}: {e}")
