"""Parameter counts and sizes of a model from its config alone; the configs shipped with trillora.

The model is built on the meta device, so a 1T-parameter config costs no
memory; counts come from the real module tree, not a separate formula that
could drift from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import ConfigError, MissingPath
from .args import ModelArgs
from .moe import GroupedExperts
from .registry import build_model, from_hf_config, load_hf_config

SHIPPED_CONFIGS = (
    "kimi-k2",
    "deepseek-v3",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "glm-4.5",
    "glm-4.5-air",
    "gpt-oss-120b",
    "gpt-oss-20b",
)
"""Architectures shipped as configs only (`configs/`, no weights): what `info` and `plan` size by name."""
FP8_BLOCK = 128


def shipped_config(name: str) -> dict:
    """A config.json shipped with trillora (facts from the public model cards)."""
    key = name.lower().replace("_", "-")
    if key not in SHIPPED_CONFIGS:
        raise ConfigError(f"no shipped config {name!r}; shipped: {', '.join(SHIPPED_CONFIGS)}")
    return json.loads(resources.files("trillora.configs").joinpath(f"{key}.json").read_text())


def resolve_args(spec: str | Path) -> ModelArgs:
    """A shipped name (`kimi-k2`), a config.json file, or a checkpoint folder."""
    path = Path(spec)
    if path.exists():
        return load_hf_config(path)[0]
    try:
        return from_hf_config(shipped_config(str(spec)), where=f"shipped config {spec}")
    except ConfigError:
        raise MissingPath(
            f"{spec}: neither a config.json / checkpoint folder nor a shipped config ({', '.join(SHIPPED_CONFIGS)})"
        ) from None


@dataclass(frozen=True, slots=True)
class ParamCounts:
    total: int
    activated: int  # per token: everything but the routed experts not chosen
    routed_experts: int
    embeddings: int  # input embedding + output head
    matrix_weights: int  # 2-D (and stacked 3-D) projection weights, the ones FP8 checkpoints quantise
    expert_matrices: int  # the stacked routed-expert weights (no biases), the ones gpt-oss ships in MXFP4

    def bytes_bf16(self) -> int:
        return 2 * self.total

    def bytes_fp8(self) -> int:
        """FP8 block-quantised projections (1 byte + an fp32 scale per 128×128 block), the rest bf16."""
        scales = 4 * self.matrix_weights // (FP8_BLOCK * FP8_BLOCK)
        return self.matrix_weights + scales + 2 * (self.total - self.matrix_weights)

    def bytes_mxfp4_experts(self) -> int:
        """Routed-expert weights in MXFP4 (half a byte each + a one-byte scale per 32), the rest bf16:
        how gpt-oss is released."""
        return self.expert_matrices // 2 + self.expert_matrices // 32 + 2 * (self.total - self.expert_matrices)


def count_params(args: ModelArgs) -> ParamCounts:
    model = build_model(args, device="meta")
    total = routed = activated_routed = matrix = expert_matrices = 0
    embeddings = model.model.embed_tokens.weight.numel()
    if not args.tie_word_embeddings:
        embeddings += model.lm_head.weight.numel()
    expert_params = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if id(p) in expert_params:
            routed += n
            activated_routed += n * args.top_k // args.num_experts
            expert_matrices += n if p.dim() == 3 else 0
        if p.dim() >= 2 and "embed_tokens" not in name and "lm_head" not in name and ".gate.weight" not in name:
            matrix += n
    return ParamCounts(
        total=total,
        activated=total - routed + activated_routed,
        routed_experts=routed,
        embeddings=embeddings,
        matrix_weights=matrix,
        expert_matrices=expert_matrices,
    )
