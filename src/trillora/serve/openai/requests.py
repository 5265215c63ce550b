"""An OpenAI request's fields checked before anything runs: the sampling settings against the
server's caps, the trace a request belongs to, and strings that can be stored."""

from __future__ import annotations

import re
import secrets

from fastapi import Request

from ...rollout.types import SamplingParams
from ..calls import BadRequest
from ..config import ServeConfig

TRACE_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def sampling_params(body: dict, cfg: ServeConfig, tokenizer) -> tuple[dict, int]:
    """The sampling settings as the service takes them (Tinker's names), checked with OpenAI's."""
    n, max_tokens, seed = body.get("n", 1), body.get("max_tokens", 16), body.get("seed")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= cfg.max_samples:
        raise BadRequest(f"n must be an integer in 1..{cfg.max_samples}")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= cfg.max_tokens_limit:
        raise BadRequest(f"max_tokens must be an integer in 1..{cfg.max_tokens_limit}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise BadRequest(f"seed must be an integer, not {type(seed).__name__}")
    stop = body.get("stop_token_ids") or []
    if not isinstance(stop, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < len(tokenizer) for t in stop
    ):
        raise BadRequest(f"stop_token_ids must be a list of token ids in 0..{len(tokenizer) - 1}")
    if tokenizer.eos_token_id is not None and not body.get("ignore_eos", False):
        stop = stop + [tokenizer.eos_token_id]
    if seed is not None and not 0 <= seed < 2**63:
        raise BadRequest(f"seed must be in 0..2**63-1, not {seed}")
    try:
        params = {
            "max_tokens": max_tokens,
            "temperature": float(body.get("temperature", 1.0)),
            "top_p": float(body.get("top_p", 1.0)),
            "top_k": max(0, int(body.get("top_k", 0) or 0)),
            "seed": seed,
            "stop": stop,
        }
        SamplingParams(max_new_tokens=max_tokens, **{k: params[k] for k in ("temperature", "top_p", "top_k", "seed")})
    except (TypeError, ValueError, OverflowError) as e:
        raise BadRequest(str(e)) from None
    return params, n


def trace_of(request: Request, body: dict) -> tuple[str, str, str]:
    """The trace a request belongs to (`X-Trace-Id`, else `metadata.trace_id`, else a new one), its
    user (`user`, else `metadata.user_id`) and its task tag (`metadata.task`)."""
    metadata = body.get("metadata", {})
    if not isinstance(metadata, dict):
        raise BadRequest("metadata must be an object of strings")
    given = request.headers.get("x-trace-id") or metadata.get("trace_id")
    if given is not None and (not isinstance(given, str) or not TRACE_ID.fullmatch(given)):
        raise BadRequest("a trace id (X-Trace-Id or metadata.trace_id) is 1-128 letters, digits, '.', '_', ':' or '-'")
    user = text_field(body.get("user", metadata.get("user_id", "")), "user (or metadata.user_id)", 256)
    tag = text_field(metadata.get("task", ""), "metadata.task", 128)
    return given or f"trace-{secrets.token_urlsafe(12)}", user, tag


def text_field(value, name: str, limit: int) -> str:
    """A string field that can be stored: at most `limit` characters, valid UTF-8 (no lone surrogate)."""
    if not isinstance(value, str) or len(value) > limit:
        raise BadRequest(f"{name} must be a string of at most {limit} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{name} is not valid Unicode (a lone surrogate)") from None
    if "\x00" in value:  # PostgreSQL's text holds none; SQLite's LENGTH stops at one
        raise BadRequest(f"{name} holds a NUL character")
    return value
