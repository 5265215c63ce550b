"""Grouped expert LoRA vs the per-expert loop (forward + backward), and adapter sizes for Kimi K2.

    python benchmarks/lora_experts.py [--tokens 1024] [--repeats 5] [--out benchmarks/results/lora_experts.json]

Both sides run in this process on the same inputs: the same `LoraGroupedExperts` module with
grouped GEMM on (`torch._grouped_mm` over expert-sorted rows) and off (a Python loop over
experts, one matmul per expert for the base and for each LoRA factor). Reported as a ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from trillora import lora
from trillora.cli.info import human, human_bytes
from trillora.lora.layers import add_adapter
from trillora.models import build_model
from trillora.models.moe import GroupedExperts, dispatch_combine
from trillora.models.params import resolve_args


def expert_block(num_experts: int, dim: int, hidden: int, rank: int) -> GroupedExperts:
    g = torch.Generator().manual_seed(0)
    m = GroupedExperts(num_experts, dim, hidden)
    with torch.no_grad():
        m.gate_up_proj.normal_(0, 0.02, generator=g)
        m.down_proj.normal_(0, 0.02, generator=g)
    m.requires_grad_(False)
    add_adapter(m, rank=rank, scaling=2.0, dropout=0.0, dtype=torch.float32, init="kaiming", generator=g)
    with torch.no_grad():
        for n in m.lora_names():
            getattr(m, n).normal_(0, 0.02, generator=g)
    return m


def time_step(m: GroupedExperts, x, idx, w, grouped: bool, repeats: int) -> float:
    m.grouped = grouped
    times = []
    for i in range(repeats + 1):  # first call warms up
        x.grad = None
        for n in m.lora_names():
            getattr(m, n).grad = None
        t0 = time.perf_counter()
        dispatch_combine(m, x, idx, w).square().mean().backward()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_grouped(tokens: int, repeats: int, dim: int, hidden: int, rank: int, top_k: int) -> list[dict]:
    rows = []
    for e in (8, 64, 384):
        m = expert_block(e, dim, hidden, rank)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(tokens, dim, generator=g, requires_grad=True)
        idx = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
        w = torch.rand(tokens, top_k, generator=g)
        loop = time_step(m, x, idx, w, grouped=False, repeats=repeats)
        grouped = time_step(m, x, idx, w, grouped=True, repeats=repeats)
        rows.append(
            dict(
                experts=e,
                tokens=tokens,
                top_k=top_k,
                dim=dim,
                hidden=hidden,
                rank=rank,
                loop_ms=1e3 * loop,
                grouped_ms=1e3 * grouped,
                speedup=loop / grouped,
            )
        )
    return rows


def adapter_sizes() -> list[dict]:
    args = resolve_args("kimi-k2")
    rows = []
    for rank in (8, 32, 128):
        for rule in ("same", "divide_by_top_k"):
            model = build_model(args, device="meta")
            lora.apply_lora(model, lora.LoraConfig(rank=rank, expert_rank_rule=rule))
            s = lora.adapter_stats(model)
            rows.append(
                dict(
                    rank=rank,
                    expert_rank=args.top_k
                    and lora.LoraConfig(rank=rank, expert_rank_rule=rule).rank_for_experts(args.top_k),
                    adapter_params=s["adapter_params"],
                    base_params=s["base_params"],
                    adapter_bytes_fp32=s["adapter_bytes"],
                    fraction=s["fraction"],
                )
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/lora_experts.json"))
    a = p.parse_args()
    torch.manual_seed(0)
    console = Console()
    grouped = bench_grouped(a.tokens, a.repeats, a.dim, a.hidden, a.rank, a.top_k)
    t = Table(title=f"expert LoRA fwd+bwd, {a.tokens} tokens, top-{a.top_k}, C={a.dim}, I={a.hidden}, r={a.rank}")
    for col in ("experts", "per-expert loop", "grouped GEMM", "speedup"):
        t.add_column(col, justify="right")
    for r in grouped:
        t.add_row(str(r["experts"]), f"{r['loop_ms']:.1f} ms", f"{r['grouped_ms']:.1f} ms", f"{r['speedup']:.1f}×")
    console.print(t)
    sizes = adapter_sizes()
    t = Table(title="Kimi K2 adapter size (LoRA on attention, dense MLP, shared and routed experts)")
    for col in ("rank", "expert rank", "adapter params", "fp32 bytes", "% of base"):
        t.add_column(col, justify="right")
    for r in sizes:
        t.add_row(
            str(r["rank"]),
            str(r["expert_rank"]),
            human(r["adapter_params"]),
            human_bytes(r["adapter_bytes_fp32"]),
            f"{100 * r['fraction']:.2f}%",
        )
    console.print(t)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"grouped_vs_loop": grouped, "kimi_k2_adapter": sizes}, indent=2))
    console.print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
