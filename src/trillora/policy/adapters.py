"""Several LoRA adapters on one resident copy of a base model.

The base is loaded once, with adapter slots on every module an adapter may train (attention,
dense MLP, shared and routed experts, the unembedding). Each trainer of the base (a Tinker
client, a learning server's learner) owns an `Adapter`: its own parameters (any rank, any subset
of those roles) and its own optimizer.
Before a request runs, `ResidentBase.use` registers that adapter's parameters in the slots
and switches the slots it does not train off; the base weights are never copied or touched.
A `Revision` is a frozen copy of an adapter's tensors (what a sampler samples from).
Requests run one at a time on the service's worker, so one set of slots serves every client;
`use_many` puts several adapters in the slots at once, for one pass whose consecutive rows
belong to different clients (`lora.multi`); under expert parallelism each routed row's adapter
travels with it (`parallel.expert_parallel`), under tensor parallelism the stacks hold this
rank's parts of the adapters and the layer's output is placed as the layer places its own.

On a sharded base (`policy.shards.Placement`: experts over ep, layers over tp, stages over pp) a new
adapter draws its whole tensors and keeps this rank's part, so it equals the one-process adapter.
Each slot draws from its own stream (the client's seed and the slot's name), on the CPU: a pipeline
stage, which holds only some slots, draws what one process draws, and so does a GPU.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import lora
from ..lora.apply import lora_modules
from ..lora.layers import LoraGroupedExperts, init_a
from ..lora.multi import RowAdapters, local_part, stack_padded
from ..models import layers, release_of
from .shards import Placement

SLOT_TENSORS = tuple(f"lora_{m}{x}" for m in ("", "gate_", "up_", "down_") for x in "AB")
SLOT_ROLES = ("attention", "mlp", "shared_experts", "experts", "lm_head")
"""Every module a client may adapt has a slot (the router does not: its LoRA changes routing)."""
TINKER_ROLES = {
    "train_attn": ("attention",),
    "train_mlp": ("mlp", "shared_experts", "experts"),
    "train_unembed": ("lm_head",),
}


def roles_of(train_attn: bool, train_mlp: bool, train_unembed: bool) -> tuple[str, ...]:
    chosen = {"train_attn": train_attn, "train_mlp": train_mlp, "train_unembed": train_unembed}
    return tuple(r for key, on in chosen.items() if on for r in TINKER_ROLES[key])


@dataclass
class Adapter:
    """One training client's LoRA: {"module.lora_X": parameter} on the modules it trains."""

    config: lora.LoraConfig
    params: dict[str, nn.Parameter]
    optimizer: torch.optim.Optimizer | None = None
    steps: int = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: p.detach() for k, p in self.params.items()}

    def modules(self) -> set[str]:
        return {k.rpartition(".")[0] for k in self.params}


@dataclass
class Revision:
    """Frozen adapter tensors for sampling (None: the base alone)."""

    config: lora.LoraConfig | None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    sampler_id: str = ""
    """The sampling session it serves (the other ranks of a sharded service find theirs by it)."""

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class ResidentBase:
    def __init__(self, model: nn.Module, alpha: float = 16.0):
        self.model, self.alpha = model, alpha
        self.in_use: Adapter | Revision | tuple | None = None
        """What `use` (or `use_many`, a tuple) put in the slots (a sharded service's sampler tells the other ranks)."""
        slots = lora.LoraConfig(rank=1, alpha=alpha, targets=SLOT_ROLES)
        self.roles = lora.apply_lora(model, slots)  # {module name: role}
        self.placement = Placement(self.roles)
        """Filled in by a sharded service once it has split the base."""
        self.slots = dict(lora_modules(model))
        for m in self.slots.values():
            m.lora_enabled = False
        self.model.requires_grad_(False)

    def new_adapter(self, rank: int, roles: tuple[str, ...], seed: int = 0, expert_rank: int | None = None) -> Adapter:
        """Fresh parameters (A random as `lora.init`, B zero) on the slots of `roles`; routed experts
        at `expert_rank` (None: `rank`), with the dense scaling."""
        cfg = lora.LoraConfig(rank=rank, alpha=self.alpha, targets=roles, seed=seed, expert_rank=expert_rank)
        params: dict[str, nn.Parameter] = {}
        for name in sorted(self.slots):
            if self.roles[name] not in roles:
                continue
            m = self.slots[name]
            r = cfg.rank_for_experts(self.model.args.top_k) if self.roles[name] == "experts" else rank
            m.add_lora(r, cfg.scaling(rank), 0.0, cfg.torch_dtype)  # registers new tensors in the slot
            for pname in m.lora_names():
                p = getattr(m, pname)
                if pname.endswith("_A"):
                    drawn = torch.empty(p.shape, dtype=p.dtype)
                    init_a(drawn, cfg.init, torch.Generator().manual_seed(slot_seed(seed, f"{name}.{pname}")))
                    with torch.no_grad():
                        p.copy_(drawn)
                key = f"{name}.{pname}"
                if self.sharded:  # drawn whole, kept in part
                    p = nn.Parameter(self.placement.shard(key, p.detach()))
                    m.register_parameter(pname, p)
                params[key] = p
            m.lora_enabled = False
        if not params:
            raise ValueError(
                f"LoRA roles {roles} match no module of this {'stage' if self.placement.stages else 'model'}"
            )
        return Adapter(cfg, params)

    def adapter_from(self, config: lora.LoraConfig, tensors: dict[str, torch.Tensor]) -> Adapter:
        """An adapter holding copies of `tensors` (a saved state or a revision)."""
        adapter = self.new_adapter(config.rank, config.targets, config.seed, config.expert_rank)
        missing = set(adapter.params) ^ set(tensors)
        if missing:
            raise ValueError(f"saved adapter tensors do not fit this model: {sorted(missing)[:3]}")
        with torch.no_grad():
            for k, p in adapter.params.items():
                local, part = layers.local(p), self.placement.slice(k, tensors[k])
                if local.shape != part.shape:
                    raise ValueError(
                        f"saved adapter tensor {k}: shape {tuple(tensors[k].shape)} does not fit "
                        f"{tuple(p.shape)} (this rank's part: {tuple(local.shape)})"
                    )
                local.copy_(part)
        return adapter

    def revision_from_folder(self, folder) -> Revision:
        """A PEFT-format adapter folder (as `trillora train` saves it) as a revision on these slots:
        its tensors only, never a copy of the base."""
        config = lora.adapter_config(folder)
        if config.patterns or config.exclude or not set(config.targets) <= set(SLOT_ROLES):
            raise lora.AdapterError(
                f"{folder}: a served adapter adapts whole roles of {list(SLOT_ROLES)}; this one has "
                f"targets={list(config.targets)}"
                f"{', patterns' if config.patterns else ''}{', exclude' if config.exclude else ''}"
            )
        if self.sharded:
            raise lora.AdapterError("adapters are loaded from folders on one process only (not yet under torchrun)")
        adapter = self.new_adapter(
            config.rank, config.targets, config.seed, config.rank_for_experts(self.model.args.top_k)
        )
        lora.fill_adapter([(m, self.slots[m]) for m in sorted(adapter.modules())], folder, release_of(self.model.args))
        return Revision(adapter.config, adapter.tensors())

    @property
    def sharded(self) -> bool:
        return self.placement.experts is not None or self.placement.tp is not None or self.placement.stages is not None

    @contextlib.contextmanager
    def use(self, adapter: Adapter | Revision | None):
        """The model with `adapter` in its slots (the other slots off); every slot off afterwards."""
        tensors, config = _tensors(adapter), adapter.config if adapter is not None else None
        self.in_use = adapter
        try:
            for name, m in self.slots.items():
                mine = [k for k in (f"{name}.{p}" for p in SLOT_TENSORS) if k in tensors]
                if not mine:
                    m.lora_enabled = False
                    continue
                for k in mine:
                    t = tensors[k]
                    setattr(
                        m,
                        k.rpartition(".")[2],
                        t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False),
                    )
                m.lora_rank = (
                    config.rank_for_experts(self.model.args.top_k) if self.roles[name] == "experts" else config.rank
                )
                m.lora_scaling = config.scaling(config.rank)
                m.lora_enabled = True
            yield self.model
        finally:
            self.in_use = None
            for m in self.slots.values():
                m.lora_enabled = False

    def _local_width(self, input_ids_BT: torch.Tensor) -> int:
        """Tokens per row the layers see: under context parallelism, this rank's share of the row."""
        cp = getattr(self.model, "context_parallel", None)
        return cp.local_width(input_ids_BT.shape[1]) if cp is not None and cp.active else input_ids_BT.shape[1]

    @contextlib.contextmanager
    def use_many(self, adapters: list[Adapter | Revision | None], rows: list[int]):
        """The model with adapter k on the next `rows[k]` batch rows (in order), in one pass."""
        device = next(self.model.parameters()).device
        scaling = [a.config.scaling(a.config.rank) if a is not None and a.config is not None else 0.0 for a in adapters]
        multi = RowAdapters(rows, scaling, device)
        every = [_tensors(a) for a in adapters]
        self.in_use = tuple(adapters)
        hook = self.model.register_forward_pre_hook(lambda _, args: multi.begin(args[0], self._local_width(args[0])))
        if hasattr(self.model, "chunk_hook"):  # pipeline stages running a pass as row chunks (`parallel.staged`)
            self.model.chunk_hook = multi.select_rows
        try:
            for name, m in self.slots.items():
                stacks = {}
                for pname in SLOT_TENSORS:
                    key = f"{name}.{pname}"
                    found = [
                        local_part(t.get(key)) for t in every
                    ]  # a replicated matrix's gradient: summed by optim_step
                    if any(f is not None for f in found):
                        rank = max(f.shape[-1 if pname.endswith("_B") else -2] for f in found if f is not None)
                        like = next(f for f in found if f is not None)
                        stacks[pname] = stack_padded(
                            found,
                            like,
                            -1 if pname.endswith("_B") else -2,
                            rank,
                            dim=1 if isinstance(m, LoraGroupedExperts) else 0,
                        )
                m.lora_multi = (multi, stacks) if stacks else None
                m.lora_enabled = bool(stacks)
            yield self.model
        finally:
            hook.remove()
            if hasattr(self.model, "chunk_hook"):
                self.model.chunk_hook = None
            self.in_use = None
            for m in self.slots.values():
                m.lora_enabled, m.lora_multi = False, None

    @staticmethod
    def revision(adapter: Adapter) -> Revision:
        return Revision(adapter.config, {k: t.clone() for k, t in adapter.tensors().items()})


def slot_seed(seed: int, slot: str) -> int:
    """The seed of one slot's stream: the client's seed mixed with the slot's name."""
    return (seed * 0x9E3779B1 + zlib.crc32(slot.encode())) % (1 << 63)


def _tensors(adapter: Adapter | Revision | None) -> dict[str, torch.Tensor]:
    if isinstance(adapter, Adapter):
        return adapter.params
    return adapter.tensors if adapter is not None else {}
