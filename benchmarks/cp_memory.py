"""Peak activation memory per rank under context parallelism (cp = 1, 2, 4) at a long sequence.

    python benchmarks/cp_memory.py [--seq-len 8192] [--cp 1 2 4] [--out benchmarks/results/cp_memory.json]

Each layout runs in its own group of spawned gloo processes on this machine: the same model
(a GQA Qwen3-MoE and an MLA DeepSeek-V3, 4 layers, LoRA on attention and experts), one row
of `--seq-len` tokens, forward + backward of the policy-gradient loss. Per rank it reports
what `trillora.plan.memory_probe.MemoryProbe` measures: the peak of live allocations above the start
(activations, gathered K/V, gradients of activations; the frozen weights were allocated
before) and the bytes autograd saved for backward. The loss column shows all layouts computed
the same thing. Ratios are against cp = 1 from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

FAMILIES = {
    "qwen3_moe (GQA)": dict(
        model_type="qwen3_moe",
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=65536,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    "deepseek_v3 (MLA)": dict(
        model_type="deepseek_v3",
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        n_shared_experts=1,
        routed_scaling_factor=1.0,
        max_position_embeddings=65536,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, family: str, seq_len: int, results) -> None:
    from trillora import lora
    from trillora.models import build_model, from_hf_config
    from trillora.parallel import ParallelDims, parallelize
    from trillora.plan.memory_probe import MemoryProbe
    from trillora.policy.logprobs import token_logprobs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, 2 // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    args = from_hf_config(FAMILIES[family], where=family)
    model = build_model(args, device="cpu")
    model.init_weights(std=0.05, generator=torch.Generator().manual_seed(0))
    lora.apply_lora(model, lora.LoraConfig(rank=8, targets=("attention", "experts")))
    parallelize(model, ParallelDims(cp=world, fsdp=False))
    data = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (1, seq_len), generator=data)
    with MemoryProbe() as probe:
        probe.exclude(list(model.parameters()))
        logp, _ = token_logprobs(model, ids)  # [1, T-1] whole rows on every rank
        loss = -logp.mean()
        loss.backward()
    loss = loss.detach()
    results.put(dict(rank=rank, peak=probe.report.peak_bytes, saved=probe.report.saved_bytes, loss=loss.item()))
    dist.destroy_process_group()


def measure(family: str, cp: int, seq_len: int) -> dict:
    ctx = mp.get_context("forkserver")
    results = ctx.SimpleQueue()
    # forkserver, not spawn: its children end with os._exit, so gloo's threads cannot abort them in
    # the interpreter's teardown (see policy.world.leave_rank)
    mp.start_processes(worker, args=(cp, free_port(), family, seq_len, results), nprocs=cp, start_method="forkserver")
    rows = [results.get() for _ in range(cp)]
    return dict(
        family=family,
        cp=cp,
        seq_len=seq_len,
        peak_bytes=max(r["peak"] for r in rows),
        saved_bytes=max(r["saved"] for r in rows),
        loss=rows[0]["loss"],
    )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(dict.fromkeys(r["family"] for r in rows))
    fig, axes = plt.subplots(1, len(families), figsize=(5 * len(families), 3.6), squeeze=False)
    for ax, fam in zip(axes[0], families, strict=True):
        mine = [r for r in rows if r["family"] == fam]
        x = range(len(mine))
        ax.bar([i - 0.2 for i in x], [r["peak_bytes"] / 2**20 for r in mine], 0.4, label="peak live")
        ax.bar([i + 0.2 for i in x], [r["saved_bytes"] / 2**20 for r in mine], 0.4, label="saved for backward")
        ax.set_xticks(list(x), [f"cp={r['cp']}" for r in mine])
        ax.set_ylabel("MiB per rank")
        ax.set_title(f"{fam}, {mine[0]['seq_len']} tokens")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/cp_memory.json"))
    a = p.parse_args()
    console = Console()
    rows = []
    with console.status("measuring") as status:
        for family in FAMILIES:
            for cp in a.cp:
                status.update(f"{family}: cp={cp}, {a.seq_len} tokens")
                rows.append(measure(family, cp, a.seq_len))
    t = Table(title=f"activation memory per rank, one row of {a.seq_len} tokens, forward + backward")
    for col in ("model", "cp", "peak live", "vs cp=1", "saved for backward", "vs cp=1", "loss"):
        t.add_column(col, justify="right")
    for r in rows:
        base = next(b for b in rows if b["family"] == r["family"] and b["cp"] == min(a.cp))
        r["peak_ratio"], r["saved_ratio"] = r["peak_bytes"] / base["peak_bytes"], r["saved_bytes"] / base["saved_bytes"]
        t.add_row(
            r["family"],
            str(r["cp"]),
            f"{r['peak_bytes'] / 2**20:.1f} MiB",
            f"{r['peak_ratio']:.2f}×",
            f"{r['saved_bytes'] / 2**20:.1f} MiB",
            f"{r['saved_ratio']:.2f}×",
            f"{r['loss']:.6f}",
        )
    console.print(t)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=2))
    plot(rows, a.out.with_suffix(".png"))
    console.print(f"wrote {a.out} and {a.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
