"""The Tinker routes that belong to the hosted service (accounts, projects, billing, external
storage, server-side features the SDK only uses when the server's client config turns them on):
what a local server answers to each, a 4xx that says why, so the SDK stops at once instead of
retrying a 404 or a 5xx. Matched on the path's pattern (`*` is one path segment)."""

from __future__ import annotations

import re

from ..calls import BadRequest

LOCAL = "checkpoints are files under the server's --state-dir; load or sample a tinker:// path directly"
LISTING = (
    "would list every client's ids: one API key serves several clients here, and an id is the right to "
    "use it; ask for your own session, run or checkpoints instead"
)

REFUSED = {
    ("POST", "copy_weights"): (400, f"copy_weights copies between a hosted account's projects; {LOCAL}"),
    ("POST", "save_weights_external"): (400, f"save_weights_external writes to external storage; {LOCAL}"),
    ("GET", "training_runs/*/checkpoints/*/*/external_weights_urls"): (400, f"no external storage here; {LOCAL}"),
    ("POST", "cancel_future"): (
        400,
        "requests run to the end in the order they came (this server's client config leaves sample_cancel_enabled off)",
    ),
    ("POST", "retrieve_futures"): (
        400,
        "poll each request with retrieve_future (this server's client config leaves sample_use_retrieve_futures off)",
    ),
    ("POST", "join_sampling_session"): (
        400,
        "create a sampling session instead (this server's client config leaves sample_join_sampling_session off)",
    ),
    ("POST", "create_custom_loss"): (
        400,
        "custom losses run in the client: forward_backward_custom computes the loss "
        "there (this server's client config leaves custom_loss_server_side off)",
    ),
    ("POST", "auth/token"): (
        400,
        "the API key is the credential here (this server's client config leaves pjwt_auth_enabled off)",
    ),
    ("GET", "audit"): (400, "a local server keeps no audit log: its requests are in its own log"),
    ("GET", "billing/usage/events"): (400, "a local server bills nothing"),
    ("GET", "billing/usage/checkpoints/current"): (
        400,
        "a local server bills nothing; the checkpoints' sizes are in list_checkpoints",
    ),
    ("PUT", "sessions/*/project"): (400, "a local server has no projects"),
    ("GET", "sessions/*/trace_export"): (400, "a local server exports no traces"),
    ("GET", "sessions"): (403, f"GET sessions {LISTING}"),
    ("POST", "sessions/search"): (403, f"sessions/search {LISTING}"),
    ("GET", "training_runs"): (403, f"GET training_runs {LISTING}"),
    ("GET", "checkpoints"): (403, f"GET checkpoints {LISTING}"),
}
_PATTERNS = [
    (method, re.compile("/api/v1/" + re.escape(p).replace(r"\*", "[^/]+") + "$"), answer)
    for (method, p), answer in REFUSED.items()
]


def refuse(method: str, path: str) -> None:
    """Raise this route's refusal (nothing when the route is not a hosted one)."""
    for m, pattern, (status, why) in _PATTERNS:
        if m == method and pattern.match(path):
            raise BadRequest(why, status)
