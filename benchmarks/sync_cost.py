"""Weight-sync cost per RL step: adapter-only vs merged weights, bytes and seconds, side by side.

    python benchmarks/sync_cost.py [--rank 16] [--repeats 5]

Measured in vLLM (in process) on two 4-layer models of the same shapes as the throughput
benchmark (hidden 256): a dense Qwen3, where vLLM on CPU can apply the adapter, so both kinds
run on the same model; and a Qwen3-MoE (8 experts), where vLLM on CPU applies no LoRA, so
merged is the only kind that runs (the adapter's bytes are shown for comparison). Seconds are
the median over repeats of `engine.sync(model)` after an optimizer-like change of the adapter.
Last, Kimi K2 sized on the meta device (no allocation): what each kind would move per step
in bf16 with the default feed-forward targets — the seed article's point (2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from trillora import lora
from trillora.checkpoint import load_model, save_model
from trillora.cli.info import human_bytes
from trillora.config import TrainConfig
from trillora.lora.apply import lora_modules
from trillora.models import build_model, from_hf_config
from trillora.models.params import resolve_args
from trillora.rollout import LocalEngine

MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
DENSE = {
    **{
        k: v
        for k, v in MOE.items()
        if k not in ("num_experts", "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size")
    },
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
}


def checkpoint(config: dict, root: Path) -> Path:
    model = build_model(from_hf_config(config), device="cpu")
    model.init_weights(std=0.05, generator=torch.Generator().manual_seed(0))
    return save_model(model, root / config["model_type"])


def nudge(model, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for _, p in lora.lora_parameters(model):
            p.add_(torch.randn(p.shape, generator=g), alpha=1e-3)


def timed_sync(engine, model, repeats: int) -> tuple[float, float]:
    costs = []
    for step in range(repeats + 1):  # the first is a warm-up
        nudge(model, step)
        costs.append(engine.sync(model))
    return costs[-1]["sync_bytes"], statistics.median(c["sync_seconds"] for c in costs[1:])


def merged_bytes_meta(model, bytes_per: int = 2) -> int:
    """Bytes of every base tensor the adapter changes (what merged sync must move)."""
    return sum(getattr(m, t).numel() * bytes_per for _, m in lora_modules(model) for t in m.delta())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/sync_cost.json"))
    a = p.parse_args()
    root = Path(tempfile.mkdtemp())
    rows = []
    try:
        from trillora.rollout.vllm import VLLMEngine
    except ImportError:
        VLLMEngine = None
    for label, config, targets in (
        ("dense Qwen3", DENSE, ("attention", "mlp")),
        ("Qwen3-MoE", MOE, ("attention", "experts")),
    ):
        path = checkpoint(config, root)
        model = load_model(path)
        lora.apply_lora(model, lora.LoraConfig(rank=a.rank, targets=targets))
        adapter_bytes = sum(f.stat().st_size for f in lora.save_adapter(model, root / f"{label}-adapter").iterdir())
        engine = LocalEngine(model, precision="fp32")
        rows.append((label, "trillora LocalEngine, merged", *timed_sync(engine, model, a.repeats)))
        if VLLMEngine is None:
            rows.append((label, "vLLM (not installed: make setup-vllm)", float("nan"), float("nan")))
            continue
        for kind in ("adapter", "merged"):
            if kind == "adapter" and "experts" in targets and not torch.cuda.is_available():
                rows.append((label, "vLLM, adapter (no MoE LoRA on CPU)", float(adapter_bytes), float("nan")))
                continue
            engine = VLLMEngine(path, model, sync=kind, sync_dir=root / f"{label}-{kind}", max_model_len=64)
            rows.append((label, f"vLLM, {kind}", *timed_sync(engine, model, a.repeats)))
            engine.close()
    k2 = build_model(resolve_args("kimi-k2"), device="meta")
    lora.apply_lora(
        k2, lora.LoraConfig(rank=128, targets=TrainConfig().lora.targets, expert_rank_rule="divide_by_top_k")
    )
    k2_adapter = lora.adapter_stats(k2)["adapter_params"] * 2
    rows.append(("Kimi K2 (meta, bf16)", "adapter (rank 128, experts 16)", float(k2_adapter), float("nan")))
    rows.append(("Kimi K2 (meta, bf16)", "merged", float(merged_bytes_meta(k2)), float("nan")))

    table = Table(title=f"weight sync per step (rank {a.rank} on the small models)")
    for col in ("model", "sync", "bytes", "seconds (median)"):
        table.add_column(col, justify="right")
    for model_name, kind, nbytes, sec in rows:
        table.add_row(
            model_name,
            kind,
            human_bytes(int(nbytes)) if nbytes == nbytes else "-",
            f"{sec * 1e3:.1f} ms" if sec == sec else "-",
        )
    Console(width=140).print(table)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps([{"model": m, "sync": k, "bytes": b, "seconds": s} for m, k, b, s in rows], indent=2))


if __name__ == "__main__":
    main()
