"""From a normalised architecture to the model module of its family."""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import deepseek_v3, glm4_moe, gpt_oss, qwen3_moe
from .args import FAMILIES, ConfigError, ModelArgs
from .transformer import CausalLM

BUILDERS: dict[str, Callable[[ModelArgs], CausalLM]] = {
    "qwen3_moe": qwen3_moe.build,
    "deepseek_v3": deepseek_v3.build,
    "glm4_moe": glm4_moe.build,
    "gpt_oss": gpt_oss.build,
}


def build_model(args: ModelArgs, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32) -> CausalLM:
    """Build the module on `device` (meta by default: no memory until materialised)."""
    if args.family not in BUILDERS:
        raise ConfigError(f"model family {args.family!r} unknown; supported model types: {', '.join(sorted(FAMILIES))}")
    with torch.device(device):
        model = BUILDERS[args.family](args)
    return model.to(dtype=dtype) if dtype != torch.float32 else model
