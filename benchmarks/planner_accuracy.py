"""The planner's memory prediction against measurement, in one process: activation memory of one
forward + backward for two model families and three LoRA target sets.

    python benchmarks/planner_accuracy.py [--seq-len 256] [--rows 4]

Predicted: `trillora.plan.cost.estimate`'s activations + transient bytes for that workload.
Measured: `MemoryProbe`'s peak of live allocations above the weights (the profiler's allocation
events on CPU), for the same rows × tokens through a model with those adapters. Allocation
sizes do not depend on the machine's speed, so a rerun gives the same bytes. Writes
benchmarks/results/planner_accuracy.json; the README quotes its range of errors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from trillora import lora
from trillora.models import build_model, from_hf_config
from trillora.parallel import ParallelDims
from trillora.plan.clusters import CLUSTERS
from trillora.plan.cost import Footprint, Training, Workload, estimate
from trillora.plan.memory_probe import MemoryProbe
from trillora.policy.logprobs import token_logprobs

RESULTS = Path(__file__).resolve().parent / "results"
ASSET = Path(__file__).resolve().parents[1] / "src" / "trillora" / "assets" / "tiny-moe" / "config.json"
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    vocab_size=100,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=True,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
TARGETS = {
    "attention + experts": ("attention", "experts"),
    "every linear": ("attention", "mlp", "shared_experts", "experts"),
    "experts only": ("experts",),
}
RANK = 8


def configs() -> dict[str, dict]:
    return {"qwen3_moe": json.loads(ASSET.read_text()), "deepseek_v3": DEEPSEEK_V3}


def measure(config: dict, targets: tuple[str, ...], rows: int, seq_len: int) -> dict:
    args = from_hf_config(config, where=config["model_type"])
    torch.manual_seed(0)
    model = build_model(args, device="cpu")
    model.init_weights(std=0.08, generator=torch.Generator().manual_seed(0))
    lora.apply_lora(model, lora.LoraConfig(rank=RANK, targets=targets))
    ids = torch.randint(0, args.vocab_size, (rows, seq_len), generator=torch.Generator().manual_seed(1))
    with MemoryProbe() as probe:
        probe.exclude(list(model.parameters()))
        (-token_logprobs(model, ids)[0].mean()).backward()
    fp = Footprint(args, Training(lora_rank=RANK, targets=targets, base_bytes=4))
    e = estimate(
        fp, ParallelDims(), Workload(seq_len=seq_len, rollouts_per_step=rows, micro_batch_rows=rows), CLUSTERS["cpu"]
    )
    predicted = e.memory["activations"] + e.memory["transient"]
    measured = probe.report.peak_bytes
    return {"predicted_bytes": predicted, "measured_bytes": measured, "error": predicted / measured - 1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--out", type=Path, default=RESULTS / "planner_accuracy.json")
    a = p.parse_args()
    torch.set_num_threads(1)
    table = Table(
        title=f"activation memory of one fwd+bwd, {a.rows} × {a.seq_len} tokens, LoRA r{RANK}, fp32, "
        f"one process: planner vs measured"
    )
    for col in ("family", "targets", "predicted MiB", "measured MiB", "error"):
        table.add_column(col, justify="right")
    rows = []
    for family, config in configs().items():
        for name, targets in TARGETS.items():
            r = {"family": family, "targets": name, **measure(config, targets, a.rows, a.seq_len)}
            rows.append(r)
            table.add_row(
                family,
                name,
                f"{r['predicted_bytes'] / 2**20:.2f}",
                f"{r['measured_bytes'] / 2**20:.2f}",
                f"{100 * r['error']:+.1f}%",
            )
    Console(width=120).print(table)
    worst = max(abs(r["error"]) for r in rows)
    best = min(abs(r["error"]) for r in rows)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {
                "seq_len": a.seq_len,
                "rows": a.rows,
                "rank": RANK,
                "results": rows,
                "abs_error_min": best,
                "abs_error_max": worst,
            },
            indent=2,
        )
    )
    print(f"errors {100 * best:.0f}-{100 * worst:.0f}%: {a.out}")


if __name__ == "__main__":
    main()
