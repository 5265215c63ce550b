"""`trillora` command line: `info`, `generate`.

Each subcommand is a thin function over the library; errors that are the
user's to fix (a bad path, an unsupported config) print one line, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from .checkpoint import CheckpointError
from .models import ConfigError


def lora_size(model_args, rank: int, rule: str) -> tuple[dict, int]:
    """Adapter size on the default targets (attention, dense MLP, shared and routed experts), on the meta device."""
    from . import lora
    from .models import build_model

    cfg = lora.LoraConfig(rank=rank, expert_rank_rule=rule)
    model = build_model(model_args, device="meta")
    lora.apply_lora(model, cfg)
    return lora.adapter_stats(model), cfg.rank_for_experts(model_args.top_k)


def cmd_info(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .info import count_params, human, human_bytes, resolve_args, structure

    model_args = resolve_args(args.model)
    counts = count_params(model_args)
    embed = model_args.vocab_size * model_args.hidden_size
    if args.json:
        print(json.dumps({
            "model_type": model_args.model_type,
            "total_params": counts.total,
            "activated_params": counts.activated,
            "activated_params_without_embedding": counts.activated - embed,
            "routed_expert_params": counts.routed_experts,
            "bytes_bf16": counts.bytes_bf16(),
            "bytes_fp8": counts.bytes_fp8(),
            "structure": dict(structure(model_args)),
            **({"lora": lora_size(model_args, args.lora_rank, args.expert_rank_rule)[0]} if args.lora_rank else {}),
        }, indent=2))
        return 0
    table = Table(title=f"trillora info: {args.model}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for label, value in structure(model_args):
        table.add_row(label, value)
    table.add_row("total parameters", f"{human(counts.total)} ({counts.total:,})")
    table.add_row("activated / token", f"{human(counts.activated)} ({human(counts.activated - embed)} without the input embedding)")
    table.add_row("routed experts", f"{human(counts.routed_experts)} ({100 * counts.routed_experts / counts.total:.1f}% of all)")
    table.add_row("weights at bf16", human_bytes(counts.bytes_bf16()))
    table.add_row("weights at fp8", human_bytes(counts.bytes_fp8()) + " (128×128 block scales, norms/embeddings bf16)")
    if args.lora_rank:
        stats, expert_rank = lora_size(model_args, args.lora_rank, args.expert_rank_rule)
        table.add_row(
            f"LoRA rank {args.lora_rank}",
            f"{human(stats['adapter_params'])} params, {human_bytes(stats['adapter_bytes'])} fp32 "
            f"({100 * stats['fraction']:.2f}% of the base; expert rank {expert_rank})",
        )
    Console().print(table)
    return 0


@torch.no_grad()
def sample_tokens(model, ids: torch.Tensor, max_new_tokens: int, temperature: float, eos: int | None, seed: int) -> list[int]:
    """Plain autoregressive sampling by full recomputation: a check that a checkpoint speaks, not a rollout engine."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(ids)[0, -1].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            nxt = int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=gen))
        out.append(nxt)
        if nxt == eos:
            break
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def cmd_generate(args: argparse.Namespace) -> int:
    from .checkpoint import load_model, load_tokenizer

    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model)
    ids = torch.tensor([tokenizer(args.prompt, add_special_tokens=False)["input_ids"]])
    new = sample_tokens(model, ids, args.max_new_tokens, args.temperature, tokenizer.eos_token_id, args.seed)
    print(args.prompt + tokenizer.decode(new, skip_special_tokens=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trillora", description="RL on Mixture-of-Experts models through LoRA")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="parameter counts, structure and sizes of a model (no weights needed)")
    p.add_argument("model", help="shipped name (kimi-k2, deepseek-v3, qwen3-30b-a3b, qwen3-235b-a22b), config.json or folder")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--lora-rank", type=int, default=0, help="also size a LoRA adapter of this rank")
    p.add_argument("--expert-rank-rule", default="same", choices=("same", "divide_by_top_k"))
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("generate", help="sample a completion from a checkpoint folder")
    p.add_argument("model", help="Hugging Face checkpoint folder with tokenizer files")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, CheckpointError, FileNotFoundError, KeyError) as e:
        print(f"trillora {args.command}: error: {e}", file=sys.stderr)
        return 2
