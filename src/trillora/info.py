"""Parameter counts and sizes of a model from its config alone.

The model is built on the meta device, so a 1T-parameter config costs no
memory; counts come from the real module tree, not a separate formula that
could drift from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .models import ModelArgs, build_model, from_hf_config, load_hf_config
from .models.moe import GroupedExperts

SHIPPED = ("kimi-k2", "deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b")
FP8_BLOCK = 128


def shipped_config(name: str) -> dict:
    """A config.json shipped with trillora (facts from the public model cards)."""
    key = name.lower().replace("_", "-")
    if key not in SHIPPED:
        raise KeyError(f"no shipped config {name!r}; shipped: {', '.join(SHIPPED)}")
    return json.loads(resources.files("trillora.configs").joinpath(f"{key}.json").read_text())


def resolve_args(spec: str | Path) -> ModelArgs:
    """A shipped name (`kimi-k2`), a config.json file, or a checkpoint folder."""
    path = Path(spec)
    if path.exists():
        return load_hf_config(path)[0]
    try:
        return from_hf_config(shipped_config(str(spec)), where=f"shipped config {spec}")
    except KeyError:
        raise FileNotFoundError(
            f"{spec}: neither a config.json / checkpoint folder nor a shipped config ({', '.join(SHIPPED)})"
        ) from None


@dataclass(frozen=True, slots=True)
class ParamCounts:
    total: int
    activated: int  # per token: everything but the routed experts not chosen
    routed_experts: int
    embeddings: int  # input embedding + output head
    matrix_weights: int  # 2-D (and stacked 3-D) projection weights, the ones FP8 checkpoints quantise

    def bytes_bf16(self) -> int:
        return 2 * self.total

    def bytes_fp8(self) -> int:
        """FP8 block-quantised projections (1 byte + an fp32 scale per 128×128 block), the rest bf16."""
        scales = 4 * self.matrix_weights // (FP8_BLOCK * FP8_BLOCK)
        return self.matrix_weights + scales + 2 * (self.total - self.matrix_weights)


def count_params(args: ModelArgs) -> ParamCounts:
    model = build_model(args, device="meta")
    total = routed = activated_routed = matrix = 0
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
        if p.dim() >= 2 and "embed_tokens" not in name and "lm_head" not in name and ".gate.weight" not in name:
            matrix += n
    return ParamCounts(
        total=total,
        activated=total - routed + activated_routed,
        routed_experts=routed,
        embeddings=embeddings,
        matrix_weights=matrix,
    )


def structure(args: ModelArgs) -> list[tuple[str, str]]:
    """(label, value) rows describing the architecture for `trillora info`."""
    attention = (
        f"MLA (q_lora {args.q_lora_rank}, kv_lora {args.kv_lora_rank}, nope {args.qk_nope_head_dim}, "
        f"rope {args.qk_rope_head_dim}, v {args.v_head_dim}), {args.num_heads} heads"
        if args.family == "deepseek_v3"
        else f"GQA {args.num_heads} q / {args.num_kv_heads} kv heads × {args.head_dim}, q/k RMSNorm"
    )
    rows = [
        ("model type", f"{args.model_type} (family {args.family})"),
        ("layers", f"{args.num_layers} ({len(args.moe_layers)} MoE, {args.num_layers - len(args.moe_layers)} dense)"),
        ("hidden / vocab", f"{args.hidden_size} / {args.vocab_size}"),
        ("attention", attention),
        ("rope", f"{args.rope.kind}, theta {args.rope.theta:g}"
         + (f", factor {args.rope.factor:g} over {args.rope.original_max_position}" if args.rope.kind == "yarn" else "")),
    ]
    if args.is_moe:
        router = (
            f"sigmoid + bias, groups {args.topk_group}/{args.n_group}, scale {args.routed_scaling_factor:g}"
            if args.router == "sigmoid"
            else "softmax" + (", renormalised top-k" if args.norm_topk_prob else "")
        )
        rows += [
            ("experts", f"{args.num_experts} routed (top-{args.top_k}, hidden {args.moe_intermediate_size})"
             + (f" + {args.n_shared_experts} shared" if args.n_shared_experts else "")),
            ("router", router),
        ]
    if args.num_mtp_layers:
        rows.append(("MTP layers", f"{args.num_mtp_layers} (skipped on load)"))
    return rows


def human(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def human_bytes(n: int) -> str:
    for scale, suffix in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n} B"
