"""`trillora info`: a model's structure, parameter counts and sizes from its config alone."""

from __future__ import annotations

import argparse
import json

from ..models import ModelArgs, release_of
from ..models.params import count_params, resolve_args


def lora_size(model_args, rank: int, rule: str) -> tuple[dict, int]:
    """Adapter size on the default targets (attention, dense MLP, shared and routed experts), on the meta device."""
    from .. import lora
    from ..models import build_model

    cfg = lora.LoraConfig(rank=rank, expert_rank_rule=rule)
    model = build_model(model_args, device="meta")
    lora.apply_lora(model, cfg)
    return lora.adapter_stats(model), cfg.rank_for_experts(model_args.top_k)


def cmd_info(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    model_args = resolve_args(args.model)
    counts = count_params(model_args)
    mxfp4 = release_of(model_args).quantized_experts == "mxfp4"
    embed = model_args.vocab_size * model_args.hidden_size
    if args.json:
        print(
            json.dumps(
                {
                    "model_type": model_args.model_type,
                    "total_params": counts.total,
                    "activated_params": counts.activated,
                    "activated_params_without_embedding": counts.activated - embed,
                    "routed_expert_params": counts.routed_experts,
                    "bytes_bf16": counts.bytes_bf16(),
                    "bytes_fp8": counts.bytes_fp8(),
                    **({"bytes_mxfp4_experts": counts.bytes_mxfp4_experts()} if mxfp4 else {}),
                    "structure": dict(structure(model_args)),
                    **(
                        {"lora": lora_size(model_args, args.lora_rank, args.expert_rank_rule)[0]}
                        if args.lora_rank
                        else {}
                    ),
                },
                indent=2,
            )
        )
        return 0
    table = Table(title=f"trillora info: {args.model}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for label, value in structure(model_args):
        table.add_row(label, value)
    table.add_row("total parameters", f"{human(counts.total)} ({counts.total:,})")
    table.add_row(
        "activated / token",
        f"{human(counts.activated)} ({human(counts.activated - embed)} without the input embedding)",
    )
    table.add_row(
        "routed experts", f"{human(counts.routed_experts)} ({100 * counts.routed_experts / counts.total:.1f}% of all)"
    )
    table.add_row("weights at bf16", human_bytes(counts.bytes_bf16()))
    table.add_row("weights at fp8", human_bytes(counts.bytes_fp8()) + " (128×128 block scales, norms/embeddings bf16)")
    if mxfp4:
        table.add_row(
            "as released", human_bytes(counts.bytes_mxfp4_experts()) + " (MXFP4 routed experts, the rest bf16)"
        )
    if args.lora_rank:
        stats, expert_rank = lora_size(model_args, args.lora_rank, args.expert_rank_rule)
        table.add_row(
            f"LoRA rank {args.lora_rank}",
            f"{human(stats['adapter_params'])} params, {human_bytes(stats['adapter_bytes'])} fp32 "
            f"({100 * stats['fraction']:.2f}% of the base; expert rank {expert_rank})",
        )
    Console().print(table)
    return 0


def structure(args: ModelArgs) -> list[tuple[str, str]]:
    """(label, value) rows describing the architecture for `trillora info`."""
    attention = (
        f"MLA (q_lora {args.q_lora_rank}, kv_lora {args.kv_lora_rank}, nope {args.qk_nope_head_dim}, "
        f"rope {args.qk_rope_head_dim}, v {args.v_head_dim}), {args.num_heads} heads"
        if args.kv_lora_rank
        else f"GQA {args.num_heads} q / {args.num_kv_heads} kv heads × {args.head_dim}"
        + (", q/k RMSNorm" if args.qk_norm else "")
        + ((", q/k/v/o bias" if args.attention_out_bias else ", q/k/v bias") if args.attention_bias else "")
        + (f", rope on {args.rope_dim} of {args.head_dim} dims" if args.rope_dim != args.head_dim else "")
        + (", learned sinks" if args.attention_sinks else "")
    )
    windows = [w for w in args.layer_windows if w]
    if windows:
        attention += f"; sliding window {max(windows)} on {len(windows)} of {args.num_layers} layers"
    rows = [
        ("model type", f"{args.model_type} (family {args.family})"),
        ("layers", f"{args.num_layers} ({len(args.moe_layers)} MoE, {args.num_layers - len(args.moe_layers)} dense)"),
        ("hidden / vocab", f"{args.hidden_size} / {args.vocab_size}"),
        ("attention", attention),
        (
            "rope",
            f"{args.rope.kind}, theta {args.rope.theta:g}"
            + (
                f", factor {args.rope.factor:g} over {args.rope.original_max_position}"
                if args.rope.kind == "yarn"
                else ""
            ),
        ),
    ]
    if args.is_moe:
        router = (
            f"sigmoid + bias, groups {args.topk_group}/{args.n_group}, scale {args.routed_scaling_factor:g}"
            if args.router == "sigmoid"
            else "biased logits, softmax over the top-k"
            if args.router == "topk_softmax"
            else "softmax" + (", renormalised top-k" if args.norm_topk_prob else "")
        )
        rows += [
            (
                "experts",
                f"{args.num_experts} routed (top-{args.top_k}, hidden {args.moe_intermediate_size})"
                + (f" + {args.n_shared_experts} shared" if args.n_shared_experts else "")
                + (", with biases" if args.expert_bias else "")
                + (f", SwiGLU clamped at {args.swiglu_limit:g}" if args.swiglu_limit else ""),
            ),
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
