"""Adding adapters to a model by role, and what one does with them: freeze the base,
count what trains, merge / unmerge, and switch them off for the reference policy."""

from __future__ import annotations

import contextlib
import fnmatch
import re
from collections.abc import Iterator

import torch
from torch import nn

from ..models.moe import ROUTERS, GroupedExperts
from ..models.registry import build_model
from ..models.transformer import CausalLM
from .config import LoraConfig
from .layers import LoraMixin, add_adapter, merge_module

_LAYER = r"model\.layers\.\d+\."
_ROLE_PATTERNS = (
    ("attention", re.compile(_LAYER + r"self_attn\.[a-z_]+$"), nn.Linear),
    ("shared_experts", re.compile(_LAYER + r"mlp\.shared_experts\.(gate|up|down)_proj$"), nn.Linear),
    ("experts", re.compile(_LAYER + r"mlp\.experts$"), GroupedExperts),
    ("router", re.compile(_LAYER + r"mlp\.gate$"), tuple(ROUTERS.values())),
    ("mlp", re.compile(_LAYER + r"mlp\.(gate|up|down)_proj$"), nn.Linear),
    ("lm_head", re.compile(r"lm_head$"), nn.Linear),
)


def role_of(name: str, module: nn.Module) -> str | None:
    for role, pattern, kind in _ROLE_PATTERNS:
        if pattern.match(name) and isinstance(module, kind):
            return role
    return None


def select_targets(model: CausalLM, cfg: LoraConfig) -> dict[str, str]:
    """{module name: role} of every module `cfg` adapts; `pattern` is the role of glob matches."""
    chosen: dict[str, str] = {}
    for name, module in model.named_modules():
        role = role_of(name, module)
        if role in cfg.targets:
            chosen[name] = role
        elif isinstance(module, nn.Linear) and any(fnmatch.fnmatchcase(name, p) for p in cfg.patterns):
            chosen[name] = role or "pattern"
    return {n: r for n, r in chosen.items() if not any(fnmatch.fnmatchcase(n, p) for p in cfg.exclude)}


def apply_lora(model: CausalLM, cfg: LoraConfig) -> dict[str, str]:
    """Freeze the base and add adapters to the targets of `cfg`; returns {module name: role}."""
    if any(isinstance(m, LoraMixin) for m in model.modules()):
        raise ValueError("model already has LoRA adapters")
    targets = select_targets(model, cfg)
    if not targets:
        raise ValueError(f"LoRA targets {cfg.targets} (patterns {cfg.patterns}) match no module of this model")
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(cfg.seed)
    expert_rank = cfg.rank_for_experts(model.args.top_k)
    for name, role in targets.items():
        module = model.get_submodule(name)
        is_experts = role == "experts"
        add_adapter(
            module,
            rank=expert_rank if is_experts else cfg.rank,
            scaling=cfg.scaling(cfg.rank),  # experts keep the dense scaling whatever their rank
            dropout=cfg.dropout,
            dtype=cfg.torch_dtype,
            init=cfg.init,
            generator=generator if next(module.parameters()).device.type == "cpu" else None,
        )
    model.lora_config = cfg
    model.lora_targets = targets
    return targets


def adapter_skeleton(model: CausalLM, device: torch.device, config: LoraConfig | None = None) -> CausalLM:
    """`model`'s structure with only its adapters (`config`, or its own) in memory: the base on the
    meta device, the adapter tensors real (zeros, to write a gathered adapter into). What exporting
    a sharded policy's adapter, or a slot adapter, needs without a copy of its base."""
    skeleton = build_model(model.args, device="meta", dtype=next(model.parameters()).dtype)
    apply_lora(skeleton, config or model.lora_config)
    for name, p in list(lora_parameters(skeleton)):
        owner, _, attr = name.rpartition(".")
        setattr(
            skeleton.get_submodule(owner),
            attr,
            nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=device), requires_grad=False),
        )
    return skeleton


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoraMixin]]:
    for name, module in model.named_modules():
        if isinstance(module, LoraMixin):
            yield name, module


def lora_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Only the adapter parameters: what the optimizer sees and the gradients reduce."""
    for name, p in model.named_parameters():
        if name.rpartition(".")[2].startswith("lora_"):
            yield name, p


def trained_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """What the optimizer steps: the adapters once applied, else every weight (full-parameter training)."""
    adapters = list(lora_parameters(model))
    return adapters or list(model.named_parameters())


def adapter_stats(model: nn.Module) -> dict[str, float]:
    """Trainable (adapter) vs base parameter counts and bytes; works on a meta-device model."""
    adapter = [p for _, p in lora_parameters(model)]
    names = {id(p) for p in adapter}
    base = [p for p in model.parameters() if id(p) not in names]
    n_adapter, n_base = sum(p.numel() for p in adapter), sum(p.numel() for p in base)
    experts = sum(p.numel() for n, p in lora_parameters(model) if ".experts.lora_" in n)
    return {
        "adapter_params": n_adapter,
        "expert_adapter_params": experts,
        "base_params": n_base,
        "adapter_bytes": sum(p.numel() * p.element_size() for p in adapter),
        "fraction": n_adapter / max(1, n_base),
    }


def merge(model: nn.Module) -> None:
    """Fold every adapter into its base weight (W += s·B·A); the adapter stops acting until `unmerge`."""
    for _, m in lora_modules(model):
        if not m.lora_merged:
            merge_module(m, +1.0)
            m.lora_merged = True


def unmerge(model: nn.Module) -> None:
    for _, m in lora_modules(model):
        if m.lora_merged:
            merge_module(m, -1.0)
            m.lora_merged = False


@contextlib.contextmanager
def disable_adapter(model: nn.Module) -> Iterator[nn.Module]:
    """The base model without a second copy: the reference policy for KL terms."""
    modules = [m for _, m in lora_modules(model)]
    if any(m.lora_merged for m in modules):
        raise RuntimeError("adapters are merged into the base weights; call lora.unmerge(model) first")
    before = [m.lora_enabled for m in modules]
    for m in modules:
        m.lora_enabled = False
    try:
        yield model
    finally:
        for m, state in zip(modules, before, strict=True):
            m.lora_enabled = state
