"""Training efficiency: achieved FLOP/s of the RL training step against this machine's matmul peak.

    python benchmarks/mfu.py [--rows 4] [--seq-len 512] [--repeats 3] [--device cpu|cuda]

The peak is measured here: the best of several square matrix products in the step's dtype —
fp32 2048³ on the CPU (bf16 products run at ~1 GFLOP/s on these cores), bf16 8192³ on a CUDA GPU,
where the base weights are bf16 and the LoRA adapters fp32 as in training (defaults there:
16 rows × 2048 tokens). The step is the
trainer's training pass (logprobs and entropy, the policy loss, backward) on `rows × seq-len`
tokens, timed after a warm-up; its FLOPs come from `trillora.plan.flops.training_flops`
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
from machine import matmul_peak, sync
from rich.console import Console
from rich.table import Table

WIDTH = dict(
    vocab_size=32000,
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
)
SHAPES = {
    "dense Qwen3 (LoRA r16)": (dict(WIDTH, model_type="qwen3", intermediate_size=4096), False),
    "Qwen3-MoE 16×top-4 (LoRA r16)": (
        dict(
            WIDTH,
            model_type="qwen3_moe",
            intermediate_size=4096,
            moe_intermediate_size=512,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=True,
        ),
        False,
    ),
    "Qwen3-MoE 16×top-4 (full)": (
        dict(
            WIDTH,
            model_type="qwen3_moe",
            intermediate_size=4096,
            moe_intermediate_size=512,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=True,
        ),
        True,
    ),
}


def step_seconds(
    config: dict,
    full: bool,
    rows: int,
    seq_len: int,
    repeats: int,
    device: torch.device,
    dtype: torch.dtype,
    profile_to: Path | None = None,
) -> tuple[float, dict, float]:
    from trillora import lora, rl
    from trillora.models import build_model, from_hf_config
    from trillora.plan.cost import Footprint, Training
    from trillora.plan.flops import training_flops
    from trillora.policy.logprobs import token_logprobs

    args = from_hf_config(config, where="benchmark")
    model = build_model(args, device="cpu")
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(0))
    model.to(device=device, dtype=dtype)
    if not full:
        lora.apply_lora(model, lora.LoraConfig(rank=16))  # fp32 adapters on any base dtype
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (rows, seq_len), generator=g).to(device)
    mask = torch.ones(rows, seq_len - 1, device=device)
    adv = torch.randn(rows, generator=g).to(device)

    def step() -> None:
        logp, entropy = token_logprobs(model, ids, 1.0, with_entropy=True)
        loss, _ = rl.policy_loss(
            logp, logp.detach(), adv, mask, global_tokens=float(mask.sum()), global_seqs=float(rows), entropy_BT=entropy
        )
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    if profile_to is not None:  # where the step's time goes, by operator
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            step()
            sync(device)
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        profile_to.write_text(prof.key_averages().table(sort_by=key, row_limit=15))
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t)
    training = Training(lora_rank=16, full=full, base_bytes=4)
    flops = training_flops(Footprint(args, training), seq_len)
    per_token = flops["forward"] + flops["backward"]
    return statistics.median(times), flops, per_token * rows * seq_len


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, help="default 4 on the CPU, 16 on a GPU")
    p.add_argument("--seq-len", type=int, help="default 512 on the CPU, 2048 on a GPU")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", type=Path, help="default benchmarks/results/mfu.json (mfu_cuda.json on a GPU)")
    a = p.parse_args()
    device = torch.device(a.device)
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    a.rows, a.seq_len = a.rows or (16 if gpu else 4), a.seq_len or (2048 if gpu else 512)
    a.out = a.out or Path(f"benchmarks/results/mfu{'_cuda' if gpu else ''}.json")
    torch.manual_seed(0)
    console = Console()
    with console.status("measuring the matmul peak"):
        peak = matmul_peak(a.repeats, device, dtype)
    rows = []
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with console.status("timing training steps") as status:
        for name, (config, full) in SHAPES.items():
            status.update(name)
            profile_to = a.out.with_name(f"{a.out.stem}_profile_{len(rows)}.txt")
            seconds, flops, total = step_seconds(config, full, a.rows, a.seq_len, a.repeats, device, dtype, profile_to)
            rows.append(
                dict(
                    shape=name,
                    seconds=seconds,
                    flops=total,
                    forward_per_token=flops["forward"],
                    backward_per_token=flops["backward"],
                    achieved=total / seconds,
                    mfu=total / seconds / peak,
                )
            )
    where = torch.cuda.get_device_name(device) if gpu else "CPU"
    t = Table(
        title=f"training step, {a.rows} × {a.seq_len} tokens, {str(dtype)[6:]} base on {where}; "
        f"matmul peak {peak / 1e9:.0f} GFLOP/s"
    )
    for col in ("shape", "fwd MFLOP/token", "bwd MFLOP/token", "step", "achieved", "MFU"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            r["shape"],
            f"{r['forward_per_token'] / 1e6:.0f}",
            f"{r['backward_per_token'] / 1e6:.0f}",
            f"{r['seconds']:.2f} s",
            f"{r['achieved'] / 1e9:.1f} GFLOP/s",
            f"{100 * r['mfu']:.0f}%",
        )
    console.print(t)
    lora_row, full_row = rows[1], rows[2]
    console.print(
        f"LoRA vs full on the MoE: {lora_row['flops'] / full_row['flops']:.2f}× the FLOPs per step "
        f"(no base weight gradients), {lora_row['seconds'] / full_row['seconds']:.2f}× the time"
    )
    a.out.write_text(json.dumps({"device": where, "dtype": str(dtype), "matmul_peak": peak, "rows": rows}, indent=2))
    for i, r in enumerate(rows):  # the profiles stay with the results
        profile = a.out.with_name(f"{a.out.stem}_profile_{i}.txt")
        console.print(f"[bold]where the time goes: {r['shape']}[/] ({profile})")
        console.print("\n".join(profile.read_text().splitlines()[:12]))


if __name__ == "__main__":
    main()
