"""Training efficiency: achieved FLOP/s of the RL training step against this machine's matmul peak.

    python benchmarks/mfu.py [--rows 4] [--seq-len 512] [--repeats 3]

The peak is measured here: the best of several fp32 2048×2048×2048 matrix products (the CPU
path computes in fp32; bf16 products run at ~1 GFLOP/s on these cores). The step is the
trainer's training pass (logprobs and entropy, the policy loss, backward) on `rows × seq-len`
tokens, timed after a warm-up; its FLOPs come from `trillora.parallel.cost.training_flops`
(2 per weight a token multiplies through, routed experts counted top-k of E, causal attention;
backward: input gradients always, weight gradients only for what is trained). Shapes: a dense
Qwen3 and a Qwen3-MoE of the same width, LoRA rank 16 on the default targets, and the MoE
trained full-parameter for contrast. The table also shows what LoRA saves per token, and a
torch profiler summary of one step per shape (top operators by self time) is printed and kept
in benchmarks/results/mfu_profile_*.txt.
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

WIDTH = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
             head_dim=64, max_position_embeddings=4096)
SHAPES = {
    "dense Qwen3 (LoRA r16)": (dict(WIDTH, model_type="qwen3", intermediate_size=4096), False),
    "Qwen3-MoE 16×top-4 (LoRA r16)": (dict(WIDTH, model_type="qwen3_moe", intermediate_size=4096, moe_intermediate_size=512,
                                           num_experts=16, num_experts_per_tok=4, norm_topk_prob=True), False),
    "Qwen3-MoE 16×top-4 (full)": (dict(WIDTH, model_type="qwen3_moe", intermediate_size=4096, moe_intermediate_size=512,
                                       num_experts=16, num_experts_per_tok=4, norm_topk_prob=True), True),
}


def matmul_peak(repeats: int) -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    times = []
    for _ in range(repeats * 3):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * 2048**3 / min(times)


def step_seconds(config: dict, full: bool, rows: int, seq_len: int, repeats: int,
                 profile_to: Path | None = None) -> tuple[float, dict, float]:
    from trillora import lora, rl
    from trillora.models import build_model, from_hf_config
    from trillora.parallel.cost import Footprint, Training, training_flops
    from trillora.policy import token_logprobs

    args = from_hf_config(config, where="benchmark")
    model = build_model(args, device="cpu")
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(0))
    if not full:
        lora.apply_lora(model, lora.LoraConfig(rank=16))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (rows, seq_len), generator=g)
    mask = torch.ones(rows, seq_len - 1)
    adv = torch.randn(rows, generator=g)

    def step() -> None:
        logp, entropy = token_logprobs(model, ids, 1.0, with_entropy=True)
        loss, _ = rl.policy_loss(logp, logp.detach(), adv, mask, global_tokens=float(mask.sum()),
                                 global_seqs=float(rows), entropy_BT=entropy)
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    if profile_to is not None:  # where the step's time goes, by operator
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        profile_to.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    training = Training(lora_rank=16, full=full, base_bytes=4)
    flops = training_flops(Footprint(args, training), seq_len)
    per_token = flops["forward"] + flops["backward"]
    return statistics.median(times), flops, per_token * rows * seq_len


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/mfu.json"))
    a = p.parse_args()
    torch.manual_seed(0)
    console = Console()
    with console.status("measuring the matmul peak"):
        peak = matmul_peak(a.repeats)
    rows = []
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with console.status("timing training steps") as status:
        for name, (config, full) in SHAPES.items():
            status.update(name)
            profile_to = a.out.with_name(f"mfu_profile_{len(rows)}.txt")
            seconds, flops, total = step_seconds(config, full, a.rows, a.seq_len, a.repeats, profile_to)
            rows.append(dict(shape=name, seconds=seconds, flops=total, forward_per_token=flops["forward"],
                             backward_per_token=flops["backward"], achieved=total / seconds, mfu=total / seconds / peak))
    t = Table(title=f"training step, {a.rows} × {a.seq_len} tokens, fp32; matmul peak {peak / 1e9:.0f} GFLOP/s")
    for col in ("shape", "fwd MFLOP/token", "bwd MFLOP/token", "step", "achieved", "MFU"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["shape"], f"{r['forward_per_token'] / 1e6:.0f}", f"{r['backward_per_token'] / 1e6:.0f}",
                  f"{r['seconds']:.2f} s", f"{r['achieved'] / 1e9:.1f} GFLOP/s", f"{100 * r['mfu']:.0f}%")
    console.print(t)
    lora_row, full_row = rows[1], rows[2]
    console.print(f"LoRA vs full on the MoE: {lora_row['flops'] / full_row['flops']:.2f}× the FLOPs per step "
                  f"(no base weight gradients), {lora_row['seconds'] / full_row['seconds']:.2f}× the time")
    a.out.write_text(json.dumps({"matmul_peak": peak, "rows": rows}, indent=2))
    for i, r in enumerate(rows):  # the profiles stay with the results
        console.print(f"[bold]where the time goes: {r['shape']}[/] ({a.out.with_name(f'mfu_profile_{i}.txt')})")
        console.print("\n".join(a.out.with_name(f"mfu_profile_{i}.txt").read_text().splitlines()[:12]))


if __name__ == "__main__":
    main()
