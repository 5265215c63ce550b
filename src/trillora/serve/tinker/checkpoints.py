"""The Tinker service's saved states as a checkpoint store: the local meaning of the hosted
checkpoint API (training runs, listing, deletion, TTLs, publishing).

A training run is a training client's `model_id`; its states live under `state_dir` as
`<run>/weights/<name>` and `<run>/sampler_weights/<name>`, each folder an `adapter.safetensors`
and a `state.json` (written atomically with the tensors: rank, roles, when, expiry, public,
user metadata), and `<run>/run.json` holds the run's own record (base model, rank, roles, user
metadata, the run id itself: folder names cannot be read back into ids). A TTL sets an expiry;
`sweep` deletes what has expired (the server runs it in the background and before each
listing). A checkpoint id is Tinker's: `weights/<name>` or `sampler_weights/<name>`.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import json
import os
import shutil
import threading
import time
from pathlib import Path

from ...checkpoint.atomic import atomic_write_text
from ..calls import BadRequest
from .checks import resolve, state_path

KINDS = {"weights": "training", "sampler_weights": "sampler"}
_NOT_STATES = ("learner", "runs")
"""What the state folder also holds and the quota leaves out: a learning server's revisions, the runs
trained under the folder."""


def _disk(folder: Path) -> int:
    """Disk blocks the files under `folder` take (links not followed); 0 once it is gone."""
    used = 0
    for where, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                used += os.lstat(os.path.join(where, name)).st_blocks * 512
    return used


def _iso(seconds: float | None) -> str | None:
    return None if seconds is None else datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat()


class CheckpointStore:
    def __init__(self, root: Path, base_model: str, max_bytes: int = 64 << 30):
        self.root, self.base_model, self.max_bytes = root, base_model, max_bytes
        self.live = lambda session_id: False
        """Whether a session still holds its clients (the routes tell): its runs' records stay."""
        self.sizes: dict[str, int] | None = None
        """Disk each run folder takes: counted whole once, then again only for a run this store changes
        (a save, a record, a deletion), so a save never walks every run's states."""
        self.lock = threading.Lock()

    def check_room(self) -> None:
        """403 once the saved states take `max_bytes` of disk (named saves in a loop wrote 1 GB/s); not a
        5xx, which the SDK retries ten times before it tells the user."""
        with self.lock:
            if self.sizes is None:
                runs = [p for p in self.root.iterdir() if p.name not in _NOT_STATES] if self.root.is_dir() else []
                self.sizes = {p.name: _disk(p) for p in runs}
            used = sum(self.sizes.values())
        if used >= self.max_bytes:
            raise BadRequest(
                f"saved states take {used / 2**20:.1f} MiB, the server's bound (--max-state-gib); "
                "delete some, or save with a TTL",
                403,
            )

    # --- the REST routes under /api/v1/training_runs/ ------------------------------------------
    def get(self, path: str, registry) -> dict:
        """GET <run> (its record; `registry` holds the live clients) or <run>/checkpoints."""
        run_id, _, rest = path.removeprefix("/api/v1/training_runs/").partition("/")
        if rest == "checkpoints":
            return {"checkpoints": self.checkpoints(run_id), "cursor": None}
        if rest:
            raise BadRequest(f"no route GET {path}", 404)
        live = registry.sessions.get(run_id.split(":")[0])
        return self.training_run(run_id, live.models.get(run_id) if live else None)

    def change(self, method: str, path: str, body: dict) -> dict:
        """DELETE a checkpoint, PUT its TTL, POST / DELETE its publication:
        <run>/checkpoints/<weights|sampler_weights>/<name>[/ttl|/publish]."""
        run_id, _, rest = path.removeprefix("/api/v1/training_runs/").partition("/checkpoints/")
        parts = rest.split("/")
        action = parts.pop() if parts[-1] in ("ttl", "publish") else None
        checkpoint_id = "/".join(parts)
        if not path.startswith("/api/v1/training_runs/") or len(parts) != 2:
            raise BadRequest(f"no route {method} {path}", 404)
        if action == "publish":
            self.publish(run_id, checkpoint_id, method == "POST")
        elif action == "ttl" and method == "PUT":
            self.set_ttl(run_id, checkpoint_id, body.get("ttl_seconds"))
        elif action is None and method == "DELETE":
            self.delete(run_id, checkpoint_id)
        else:
            raise BadRequest(f"no route {method} {path}", 404)
        return {}

    # --- the store ------------------------------------------------------------------------------
    def run_folder(self, run_id: str) -> Path:
        _, folder = state_path(self.root, run_id, "weights", "x")
        return folder.parent.parent

    def recount(self, folder: Path) -> None:
        """The run folder `folder` (or one inside it) has changed on disk."""
        run = self.root / folder.relative_to(self.root).parts[0]
        with self.lock:
            if self.sizes is not None and run.name not in _NOT_STATES:
                self.sizes[run.name] = _disk(run)
                if not self.sizes[run.name]:
                    del self.sizes[run.name]

    def record_run(self, run_id: str, rank: int, roles: tuple[str, ...], user_metadata: dict | None) -> None:
        folder = self.run_folder(run_id)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(
            folder / "run.json",
            json.dumps(
                {
                    "training_run_id": run_id,
                    "base_model": self.base_model,
                    "lora_rank": rank,
                    "roles": list(roles),
                    "user_metadata": user_metadata or {},
                    "created": time.time(),
                }
            ),
        )
        self.recount(folder)

    def _checkpoint(self, run_id: str, checkpoint_id: str) -> tuple[str, Path, dict]:
        kind, _, name = checkpoint_id.partition("/")
        if kind not in KINDS:
            raise BadRequest(f"checkpoint id {checkpoint_id!r}: want weights/<name> or sampler_weights/<name>")
        _, _, folder = resolve(self.root, f"tinker://{run_id}/{kind}/{name}")
        return f"tinker://{run_id}/{checkpoint_id}", folder, json.loads((folder / "state.json").read_text())

    def describe(self, tinker_path: str, meta: dict, folder: Path) -> dict:
        kind = tinker_path.split("/")[3]
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        return {
            "checkpoint_id": "/".join(tinker_path.split("/")[3:]),
            "checkpoint_type": KINDS[kind],
            "time": _iso(meta.get("time", folder.stat().st_mtime)),
            "tinker_path": tinker_path,
            "size_bytes": size,
            "public": bool(meta.get("public")),
            "user_metadata": meta.get("user_metadata") or None,
            "expires_at": _iso(meta.get("expires")),
        }

    def checkpoints(self, run_id: str) -> list[dict]:
        self.sweep()
        out, folder = [], self.run_folder(run_id)
        for kind in KINDS:
            for state in sorted((folder / kind).glob("*/state.json")) if (folder / kind).is_dir() else []:
                if not state.is_symlink():
                    path = f"tinker://{run_id}/{kind}/{state.parent.name}"
                    out.append(self.describe(path, json.loads(state.read_text()), state.parent))
        return sorted(out, key=lambda c: c["time"])

    def annotate(self, tinker_path: str, ttl_seconds=None, user_metadata: dict | None = None) -> None:
        """A fresh save's TTL and user metadata (`save_weights` carries them)."""
        run_id, _, checkpoint_id = tinker_path[len("tinker://") :].partition("/")
        if ttl_seconds is not None:
            self.set_ttl(run_id, checkpoint_id, ttl_seconds)
        if user_metadata:
            self._update(run_id, checkpoint_id, user_metadata={str(k): str(v) for k, v in user_metadata.items()})

    def delete(self, run_id: str, checkpoint_id: str) -> None:
        _, folder, _ = self._checkpoint(run_id, checkpoint_id)
        shutil.rmtree(folder)
        self._prune(folder.parent.parent)

    def end_runs(self, session_ids: list[str]) -> None:
        """Ended sessions' runs: a run's record (`run.json`, its metadata) goes with it, unless a saved
        state still names the run; then it goes with the last of them (`delete`, `sweep`)."""
        for sid in session_ids:
            for folder in self.root.glob(f"{glob.escape(sid)}_train_*"):
                self._prune(folder)

    def _prune(self, folder: Path) -> None:
        """After a run lost a saved state or its session: the folder goes once nothing of it is left (no
        saved state, its session over); recounted either way."""
        ended = "_train_" in folder.name and not folder.is_symlink() and not self.live(folder.name.split("_train_")[0])
        if ended and not any(any((folder / kind).glob("*/state.json")) for kind in KINDS):
            shutil.rmtree(folder, ignore_errors=True)
        self.recount(folder)

    @staticmethod
    def check_ttl(ttl_seconds) -> None:
        if ttl_seconds is not None and (type(ttl_seconds) is not int or ttl_seconds < 0):
            raise BadRequest(f"ttl_seconds={ttl_seconds!r}; allowed: an integer >= 0, or null for no expiry")

    def set_ttl(self, run_id: str, checkpoint_id: str, ttl_seconds) -> None:
        self.check_ttl(ttl_seconds)
        self._update(run_id, checkpoint_id, expires=None if ttl_seconds is None else time.time() + ttl_seconds)

    def publish(self, run_id: str, checkpoint_id: str, public: bool) -> None:
        self._update(run_id, checkpoint_id, public=public)

    def _update(self, run_id: str, checkpoint_id: str, **changes) -> None:
        _, folder, meta = self._checkpoint(run_id, checkpoint_id)
        atomic_write_text(folder / "state.json", json.dumps({**meta, **changes}))

    def sweep(self) -> int:
        """Delete every checkpoint whose TTL has passed; how many went."""
        gone, now = 0, time.time()
        for state in self.root.glob("*/*/*/state.json") if self.root.is_dir() else []:
            try:
                expires = json.loads(state.read_text()).get("expires")
            except (OSError, ValueError):
                continue
            if expires is not None and expires <= now and not state.parent.is_symlink():
                shutil.rmtree(state.parent, ignore_errors=True)
                self._prune(state.parent.parent.parent)
                gone += 1
        return gone

    def training_run(self, run_id: str, live=None) -> dict:
        """The run's record (from the live client `live` when it is held, else from run.json)."""
        folder = self.run_folder(run_id)
        record = json.loads((folder / "run.json").read_text()) if (folder / "run.json").is_file() else None
        if record is None and live is None:
            raise BadRequest(f"unknown training run {run_id!r}", 404)
        record = record or {"lora_rank": live.rank, "user_metadata": {}}
        saved = self.checkpoints(run_id)
        last = {
            kind: next((c for c in reversed(saved) if c["checkpoint_type"] == kind), None) for kind in KINDS.values()
        }
        return {
            "training_run_id": run_id,
            "base_model": self.base_model,
            "model_owner": "local",
            "is_lora": True,
            "corrupted": False,
            "lora_rank": record["lora_rank"],
            "last_request_time": _iso(time.time() if live is not None else record.get("created", time.time())),
            "last_checkpoint": last["training"],
            "last_sampler_checkpoint": last["sampler"],
            "user_metadata": record.get("user_metadata") or None,
        }
