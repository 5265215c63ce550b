"""Peak memory of one RL update, LoRA vs full-parameter, on the same mid-size MoE and batch.

    python benchmarks/memory_lora_vs_full.py [--rows 8] [--micro-rows 1] [--seq-len 256] [--rank 16] [--device cpu|cuda]

A random Qwen3-MoE of ~290M parameters (8 layers, hidden 1024, 16 experts top-4) in fp32 on
the CPU. On a CUDA GPU (`--device cuda`, the default when one is present) the base is bf16 with fp32
adapters; full-parameter then trains the bf16 weights directly (bf16 AdamW state), a lower bound on
mixed-precision full training, which keeps fp32 master weights too. Each side runs the trainer's update in its own
process (so one side's allocations
cannot hide the other's): the policy-gradient loss with GRPO-style advantages over
`rows × seq-len` tokens in micro-batches of `micro-rows` rows (gradients accumulated, as
`parallel.micro_batch_rows` does in the trainer), then one AdamW step (its state is allocated
inside the measurement). With whole-batch passes (`--micro-rows 8`) activations dominate both
sides and the ratio shrinks toward 1; micro-batching is what RL trainers do at long sequences. Peak = the weights
(counted) + the highest total of live allocations during the
step (`trillora.plan.memory_probe.MemoryProbe`). The theoretical floor is the base weights alone.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

CONFIG = dict(
    model_type="qwen3_moe",
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    max_position_embeddings=4096,
)


def one_step(full: bool, rows: int, micro: int, seq_len: int, rank: int, device: str, out) -> None:
    from trillora import lora, rl
    from trillora.models import build_model, from_hf_config
    from trillora.plan.memory_probe import MemoryProbe
    from trillora.policy.logprobs import token_logprobs

    torch.manual_seed(0)
    args = from_hf_config(CONFIG, where="benchmark")
    model = build_model(args, device="cpu")
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(0))
    model.to(device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    if full:
        params = list(model.parameters())
    else:
        lora.apply_lora(model, lora.LoraConfig(rank=rank))
        params = [p for _, p in lora.lora_parameters(model)]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    base = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
    opt = torch.optim.AdamW(params, lr=1e-5)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (rows, seq_len), generator=g).to(device)
    mask = torch.ones(rows, seq_len - 1, device=device)
    adv = rl.group_advantages(torch.rand(rows // 4, 4, generator=g), "grpo", True).reshape(-1).to(device)
    with MemoryProbe() as probe:
        probe.exclude(list(model.parameters()))
        for part in torch.arange(rows).split(micro):  # one normaliser for the whole batch: gradients add up
            logp, entropy = token_logprobs(model, ids[part], 1.0, with_entropy=True)
            loss, _ = rl.policy_loss(
                logp,
                logp.detach(),
                adv[part],
                mask[part],
                global_tokens=float(mask.sum()),
                global_seqs=float(rows),
                entropy_BT=entropy,
            )
            loss.backward()
            del logp, entropy, loss
        opt.step()
        opt.zero_grad(set_to_none=True)
    out.put(
        dict(
            mode="full" if full else f"LoRA r{rank}",
            params=sum(p.numel() for p in model.parameters()),
            trainable=sum(p.numel() for p in params),
            weights=weights,
            base=base,
            step_peak=probe.report.peak_bytes,
            peak=weights + probe.report.peak_bytes,
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--micro-rows", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--out",
        type=Path,
        help="default benchmarks/results/memory_lora_vs_full.json (_micro8 with --micro-rows 8, _cuda on a GPU)",
    )
    a = p.parse_args()
    micro = f"_micro{a.micro_rows}" if a.micro_rows != 1 else ""
    a.out = a.out or Path(f"benchmarks/results/memory_lora_vs_full{micro}{'_cuda' if a.device == 'cuda' else ''}.json")
    console = Console()
    ctx = mp.get_context("spawn")
    rows = []
    with console.status("measuring") as status:
        for full in (False, True):
            status.update("full-parameter step" if full else "LoRA step")
            q = ctx.Queue()
            proc = ctx.Process(target=one_step, args=(full, a.rows, a.micro_rows, a.seq_len, a.rank, a.device, q))
            proc.start()
            rows.append(q.get())
            proc.join()
    lora_row, full_row = rows
    gib = 2**30
    t = Table(
        title=f"peak memory of one RL update, {a.rows} × {a.seq_len} tokens in micro-batches of {a.micro_rows}, "
        f"{full_row['params'] / 1e6:.0f}M-parameter MoE, {'bf16 base on CUDA' if a.device == 'cuda' else 'fp32'}"
    )
    for col in ("", "trained params", "weights", "step (activations, grads, AdamW)", "peak", "vs full"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            r["mode"],
            f"{r['trainable'] / 1e6:.1f}M",
            f"{r['weights'] / gib:.2f} GiB",
            f"{r['step_peak'] / gib:.2f} GiB",
            f"{r['peak'] / gib:.2f} GiB",
            f"{r['peak'] / full_row['peak']:.2f}×",
        )
    t.add_row(
        "floor: base weights",
        "",
        f"{lora_row['base'] / gib:.2f} GiB",
        "",
        f"{lora_row['base'] / gib:.2f} GiB",
        f"{lora_row['base'] / full_row['peak']:.2f}×",
    )
    console.print(t)
    ratio = lora_row["peak"] / full_row["peak"]
    console.print(f"LoRA / full = {ratio:.2f} (target ≤ 0.40: {'met' if ratio <= 0.4 else 'missed'})")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"rows": rows, "micro_rows": a.micro_rows, "lora_over_full": ratio}, indent=2))


if __name__ == "__main__":
    main()
