"""A Tinker client's saved states: `save_state` writes its adapter and AdamW moments under
tinker://.../weights/<name>, `load_state` makes a new client of one, `save_for_sampler` freezes a
revision (written as tinker://.../sampler_weights/<name>, or a sampling session at once). Every
folder is written atomically, by rank 0 alone (`service.writes`) from the gathered tensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch

from ... import lora
from ...checkpoint.train_state import (
    CheckpointCorrupt,
    read_adapter_state,
    restore_rank_tensors,
    state_meta,
    write_state,
)
from ...policy import adamw
from ...policy.adapters import SLOT_ROLES, ResidentBase
from ...policy.policy import Policy
from ...policy.world import World
from ..calls import BadRequest
from ..registry import Client, Registry


class TinkerService(Protocol):
    """What saving and loading states reads of `tinker.service.TinkerService`."""

    base: ResidentBase
    ranks: World
    registry: Registry
    device: torch.device
    writes: bool

    def client(self, model_id: str) -> Client: ...
    def resolve(self, tinker_path: str) -> tuple[str, str, Path]: ...
    def state_path(self, model_id: str, kind: str, name: str) -> tuple[str, Path]: ...


def save_state(service: TinkerService, model_id: str, name: str, optimizer: bool = True) -> dict:
    """The client's adapter and AdamW moments as one saved state (`Policy.save`)."""
    client = service.client(model_id)
    path, folder = service.state_path(model_id, "weights", name)
    a = client.adapter
    a.optimizer = a.optimizer or adamw(a.params.values())
    Policy.of_adapter(service.base, service.ranks, a).save(folder, state_meta(a.config, a.steps, a.optimizer))
    return {"path": path, "type": "save_weights"}


def saved_state(folder: Path, kind: str, tinker_path: str, tensors: bool = True):
    """`train_state.read_adapter_state` of a resolved tinker:// path (a run's checkpoint read as one
    whatever else its folder holds); one it cannot read is a 400 naming the path."""
    try:
        return read_adapter_state(folder, run=kind == "checkpoint", tensors=tensors)
    except CheckpointCorrupt as e:
        raise BadRequest(f"{tinker_path!r} cannot be read: {e}".replace(str(folder), "its folder")) from None


def slot_config(service: TinkerService, lora_fields: dict, where: str) -> lora.LoraConfig:
    """The slot adapter's LoRA settings for a saved state's (`train_state.read_adapter_state`), or
    BadRequest naming what the resident base's slots cannot hold: they adapt whole roles at the
    server's alpha (`--lora-alpha`), with the dense scaling alpha / rank."""
    f = lora_fields
    if f.get("alpha", service.base.alpha) != service.base.alpha:
        raise BadRequest(
            f"{where} was trained with lora alpha {f['alpha']}; this server's adapters use {service.base.alpha}"
        )
    if f.get("rslora") or f.get("patterns") or f.get("exclude"):
        raise BadRequest(f"{where} uses rslora, patterns or exclude; the server's slots adapt whole roles")
    roles = tuple(f["targets"])
    if not roles or not set(roles) <= set(SLOT_ROLES):
        raise BadRequest(f"{where} adapts {list(roles)}; the server's slots are {list(SLOT_ROLES)}")
    expert_rank = f.get("expert_rank")
    if expert_rank is None and f.get("expert_rank_rule") == "divide_by_top_k":
        expert_rank = max(1, f["rank"] // service.base.model.args.top_k)
    return lora.LoraConfig(
        rank=f["rank"], alpha=service.base.alpha, targets=roles, seed=f.get("seed", 0), expert_rank=expert_rank
    )


def load_state(service: TinkerService, sid: str, seq: int, tinker_path: str, optimizer: bool) -> dict:
    """A new training client from a saved state, or a `trillora train` checkpoint (with its AdamW
    moments when `optimizer`)."""
    _, kind, folder = service.resolve(tinker_path)
    if kind == "sampler_weights":
        raise BadRequest(f"{tinker_path!r} holds sampler weights; load a tinker://.../weights/... state")
    saved = saved_state(folder, kind, tinker_path)
    config = slot_config(service, saved.lora, tinker_path)
    tensors = service.base.placement.here(saved.tensors)
    adapter = service.base.adapter_from(
        config, {k[len("param.") :]: v for k, v in tensors.items() if k.startswith("param.")}
    )
    adapter.optimizer = adamw(adapter.params.values())
    if optimizer:
        restore_rank_tensors(
            service.base.placement.local(tensors), adapter.params, adapter.optimizer, folder, rng=False
        )
        meta = json.loads((folder / "state.json").read_text())
        for g, kept in zip(adapter.optimizer.param_groups, meta.get("param_groups", []), strict=False):
            g.update({k: tuple(v) if isinstance(v, list) else v for k, v in kept.items()})
        adapter.steps = saved.optimizer_steps
    out = service.registry.register(sid, seq, Client("", adapter, config.rank, config.targets))
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
        write_state(folder, tensors, state_meta(revision.config, client.adapter.steps))
    return {"path": path, "type": "save_weights_for_sampler"}
