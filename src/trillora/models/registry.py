"""The model families trillora knows, one line each, and the two ways in: a `config.json` to
`ModelArgs` (`from_hf_config`), and `ModelArgs` to a module (`build_model`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, MissingPath
from . import deepseek_v3, glm4_moe, gpt_oss, qwen3_moe
from .args import ModelArgs, validate
from .config_keys import common_keys
from .family import Family, ReleaseLayout
from .transformer import CausalLM

FAMILIES: dict[str, Family] = {}
"""family name -> Family."""
MODEL_TYPES: dict[str, Family] = {}
"""config.json model_type -> Family."""


def register(family: Family) -> Family:
    """Make a family's model types loadable; a model_type already taken is refused by name."""
    for model_type in family.model_types:
        if MODEL_TYPES.get(model_type, family) is not family:
            raise ConfigError(f"model_type {model_type!r} is already read by family {MODEL_TYPES[model_type].name!r}")
    FAMILIES[family.name] = family
    MODEL_TYPES.update(dict.fromkeys(family.model_types, family))
    return family


register(qwen3_moe.FAMILY)
register(deepseek_v3.FAMILY)
register(glm4_moe.FAMILY)
register(gpt_oss.FAMILY)


def family_of(args: ModelArgs) -> Family:
    if args.family not in FAMILIES:
        raise ConfigError(
            f"model family {args.family!r} unknown; supported model types: {', '.join(sorted(MODEL_TYPES))}"
        )
    return FAMILIES[args.family]


def release_of(args: ModelArgs) -> ReleaseLayout:
    """How this model's family names and lays out its released tensors."""
    return family_of(args).release


def model_type_of(cfg: dict, where: str = "config.json") -> str:
    model_type = cfg.get("model_type")
    if model_type in MODEL_TYPES:
        return model_type
    if model_type is None:
        for arch in cfg.get("architectures") or []:
            for family in FAMILIES.values():
                if arch in family.architectures:
                    return family.architectures[arch]
    raise ConfigError(
        f"{where}: model_type {model_type!r} is not supported; supported model types: {', '.join(sorted(MODEL_TYPES))}"
    )


def from_hf_config(cfg: dict[str, Any], where: str = "config.json") -> ModelArgs:
    """Normalise a Hugging Face config dict (any of the spellings we know) into `ModelArgs`; the
    original dict rides along so that a checkpoint saved back carries the user's config untouched."""
    model_type = model_type_of(cfg, where)
    family = MODEL_TYPES[model_type]
    args = family.parse(cfg, {"model_type": model_type, "family": family.name, **common_keys(cfg, where)}, where)
    validate(args, where)
    return args


def load_hf_config(path: str | Path) -> tuple[ModelArgs, dict[str, Any]]:
    """Read `config.json` (or a folder holding it) into (ModelArgs, raw dict)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise MissingPath(f"no config.json at {file}")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    return from_hf_config(raw, where=str(file)), raw


def build_model(args: ModelArgs, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32) -> CausalLM:
    """Build the module on `device` (meta by default: no memory until materialised)."""
    family = family_of(args)
    with torch.device(device):
        model = family.build(args)
    return model.to(dtype=dtype) if dtype != torch.float32 else model
