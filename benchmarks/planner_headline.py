"""The seed's headline on paper: Kimi K2, LoRA rank 128 on attention, dense MLP, shared and routed
experts, 512 rollouts per step on H800s, at 16k and 32k tokens per sequence.

    python benchmarks/planner_headline.py

Runs `trillora plan --json` (the command the README shows) for both lengths on 64 GPUs and keeps
what the README quotes: whether the best layout fits, its memory per GPU against the usable
memory, the fewest GPUs LoRA and full-parameter training need, and their ratio. Writes
benchmarks/results/planner_headline.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parent / "results"


def plan(seq_len: int, gpus: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "trillora",
        "plan",
        "--model",
        "kimi-k2",
        "--gpus",
        str(gpus),
        "--gpu",
        "h800",
        "--seq-len",
        str(seq_len),
        "--rollouts",
        "512",
        "--lora-rank",
        "128",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)  # exit status 1: no layout fits (the report says so)
    if out.returncode not in (0, 1):
        raise SystemExit(out.stderr)
    report = json.loads(out.stdout)
    chosen = report["best"][0] if report["fits"] else report["least_memory"]
    cluster = report["cluster"]
    return {
        "seq_len": seq_len,
        "gpus": gpus,
        "fits": report["fits"],
        "layout": chosen["layout"],
        "memory_total_gib": chosen["memory_total_gib"],
        "usable_gib": cluster["memory_gib"] * (1 - cluster["reserve"]),
        **report["lora_vs_full"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--out", type=Path, default=RESULTS / "planner_headline.json")
    a = p.parse_args()
    console = Console(width=120)
    rows = []
    with console.status("planning") as status:
        for seq_len in (16384, 32768):
            status.update(f"Kimi K2 at {seq_len} tokens")
            rows.append(plan(seq_len, a.gpus))
    table = Table(title=f"Kimi K2, LoRA r128, 512 rollouts per step, H800: the best layout on {a.gpus} GPUs")
    for col in ("tokens", "fits", "GiB per GPU (usable)", "LoRA needs", "full-parameter needs", "LoRA / full"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["seq_len"]),
            str(r["fits"]),
            f"{r['memory_total_gib']:.1f} ({r['usable_gib']:.0f})",
            f"{r['lora_min_gpus']} GPUs",
            f"{r['full_min_gpus']} GPUs",
            f"{100 * r['ratio']:.0f}%",
        )
    console.print(table)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
