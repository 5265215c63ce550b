"""A Tinker client's saved states: `save_state` writes its adapter and AdamW moments under
tinker://.../weights/<name>, `load_state` makes a new client of one, `save_for_sampler` freezes a
revision (written as tinker://.../sampler_weights/<name>, or a sampling session at once). Every
folder is written atomically, by rank 0 alone (`service.writes`) from the gathered tensors."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file

from .. import lora
from ..checkpoint.atomic import AtomicFolder
from ..checkpoint.train_state import rank_tensors, restore_rank_tensors
from ..policy import adamw
from ..policy.adapters import ResidentBase
from .registry import Registry
from .tinker_types import BadRequest, Client


class TinkerService(Protocol):
    """What saving and loading states reads of `tinker_service.TinkerService`."""

    base: ResidentBase
    registry: Registry
    device: torch.device
    writes: bool

    def client(self, model_id: str) -> Client: ...
    def resolve(self, tinker_path: str) -> tuple[str, str, Path]: ...
    def state_path(self, model_id: str, kind: str, name: str) -> tuple[str, Path]: ...


def save_state(service: TinkerService, model_id: str, name: str, optimizer: bool = True) -> dict:
    client = service.client(model_id)
    path, folder = service.state_path(model_id, "weights", name)
    a = client.adapter
    if a.optimizer is None:
        a.optimizer = adamw(a.params.values())
    meta = {
        "rank": client.rank,
        "roles": list(client.roles),
        "seed": a.config.seed,
        "expert_rank": a.config.expert_rank,
        "steps": a.steps,
        "time": time.time(),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in a.optimizer.param_groups],
    }
    tensors = service.base.placement.full(rank_tensors(a.params, a.optimizer), service.device)
    if service.writes:
        with AtomicFolder(folder) as tmp:
            save_file({k: t.cpu() for k, t in tensors.items()}, str(tmp / "adapter.safetensors"))
            (tmp / "state.json").write_text(json.dumps(meta))
    return {"path": path, "type": "save_weights"}


def load_state(service: TinkerService, sid: str, seq: int, tinker_path: str, optimizer: bool) -> dict:
    """A new training client from a saved state (with its AdamW moments when `optimizer`)."""
    _, kind, folder = service.resolve(tinker_path)
    if kind != "weights":
        raise BadRequest(f"{tinker_path!r} holds sampler weights; load a tinker://.../weights/... state")
    meta = json.loads((folder / "state.json").read_text())
    tensors = service.base.placement.here(load_file(str(folder / "adapter.safetensors")))
    roles = tuple(meta["roles"])
    adapter = service.base.adapter_from(
        lora.LoraConfig(
            rank=meta["rank"],
            alpha=service.base.alpha,
            targets=roles,
            seed=meta["seed"],
            expert_rank=meta.get("expert_rank"),
        ),
        {k[len("param.") :]: v for k, v in tensors.items() if k.startswith("param.")},
    )
    adapter.optimizer = adamw(adapter.params.values())
    if optimizer:
        restore_rank_tensors(service.base.placement.local(tensors), adapter.params, adapter.optimizer, folder)
        for g, saved in zip(adapter.optimizer.param_groups, meta["param_groups"], strict=True):
            g.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
        adapter.steps = meta["steps"]
    out = service.registry.register(sid, seq, Client("", adapter, meta["rank"], roles))
    return {"model_id": out["model_id"], "path": tinker_path, "type": "load_weights"}


def save_for_sampler(
    service: TinkerService, model_id: str, name: str | None, sid: str | None = None, sampler_seq: int = 0
) -> dict:
    """A frozen revision: named ones are written as tinker://.../sampler_weights/<name>; unnamed
    ones become a sampling session at once."""
    client = service.client(model_id)
    revision = ResidentBase.revision(client.adapter)
    if name is None:
        return {
            "sampling_session_id": service.registry.add_sampler(
                sid or model_id.split(":")[0], sampler_seq, revision, True
            )
        }
    path, folder = service.state_path(model_id, "sampler_weights", name)
    tensors = service.base.placement.full(revision.tensors, service.device)
    if service.writes:
        with AtomicFolder(folder) as tmp:
            save_file({k: t.contiguous().cpu() for k, t in tensors.items()}, str(tmp / "adapter.safetensors"))
            (tmp / "state.json").write_text(
                json.dumps(
                    {
                        "rank": client.rank,
                        "roles": list(client.roles),
                        "time": time.time(),
                        "expert_rank": client.adapter.config.expert_rank,
                        "seed": client.adapter.config.seed,
                    }
                )
            )
    return {"path": path, "type": "save_weights_for_sampler"}
