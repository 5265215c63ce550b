"""End-to-end GRPO step: `trillora train` vs TRL's GRPOTrainer + PEFT, the same work (`pip install -e '.[bench]'`).

    python benchmarks/grpo_vs_trl.py [--steps 12] [--warmup 3] [--rounds 2] [--no-profile] [key=value ...]

Both train LoRA (rank 8 on the routed experts: the default job's targets) on the shipped tiny MoE
for 3-digit addition: 32 prompts × 8 samples per step, up to 6 new tokens, T = 1, one AdamW step
per batch; every shared setting comes from one trillora config (`trl_side.py`; key=value overrides
go to both sides). Each side runs in its own process, warm: the first `--warmup` steps are not
timed and steps that evaluate are left out; the sides alternate for `--rounds` runs each. Reported: median seconds per
step, steps/s and
generated tokens/s, side by side, and (unless `--no-profile`) a torch profiler summary of a few
more steps of each side in `benchmarks/results/grpo_step_profile_{trillora,trl}.txt`.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import machine, matmul_peak
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parent / "results"


def bench_args(steps: int, out_dir: Path, overrides: list[str]) -> list[str]:
    """The default job, named `bench`, with no evaluation inside the timed steps."""
    return [
        f"steps={steps}",
        f"out_dir={out_dir}",
        "name=bench",
        f"eval_every={steps + 1}",
        'task.retention=""',
        "task.eval_problems=16",
        *overrides,
    ]


def bench_config(steps: int, out_dir: Path, overrides: list[str]):
    from trillora.config import load_config

    return load_config(None, bench_args(steps, out_dir, overrides))


def profile_table(prof, limit: int = 30) -> str:
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=limit)


def run_trillora(steps: int, warmup: int, overrides: list[str], work: Path) -> dict:
    """`trillora train` as a user runs it, in a child process; per-step times from its metrics."""
    cfg = bench_config(warmup + steps, work, overrides)
    subprocess.run(
        [sys.executable, "-m", "trillora", "train", *bench_args(cfg.steps, work, overrides)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    rows = [json.loads(x) for x in (work / "bench" / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows[1:] if r["step"] > warmup and "eval_seconds" not in r]
    batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    return {
        "step_seconds": [r["step_seconds"] for r in timed],
        "tokens": [r["completion_len_mean"] * batch for r in timed],
        # model FLOPs (trillora.trainer.flops: a shared prompt counted for every row, as TRL runs it)
        "flops": [r["flops_rollout"] + r["flops_train"] for r in timed],
        "rollout_seconds": statistics.median(r["rollout_seconds"] for r in timed),
        "update_seconds": statistics.median(r["update_seconds"] for r in timed),
        # what the step spends outside its two measured phases (the engine sync, logging): an unmeasured
        # cost cannot hide between them while this stays small
        "unaccounted_fraction": statistics.median(
            1 - (r["rollout_seconds"] + r["update_seconds"]) / r["step_seconds"] for r in timed
        ),
    }


def run_trl(steps: int, warmup: int, overrides: list[str], work: Path) -> dict:
    from trl_side import StepClock, completion_lengths, exact_match_reward, make_trainer

    from trillora.tasks import make_task

    cfg = bench_config(warmup + steps, work, overrides)
    task = make_task(cfg.task.name, **cfg.task.options)
    problems = task.problems("train", 64 * cfg.rollout.prompts_per_step, seed=cfg.seed)
    rows = [{"prompt": "<bos>" + p.prompt, "answer": p.answer} for p in problems]
    clock = StepClock()
    trainer = make_trainer(cfg, rows, exact_match_reward, work / "trl", cfg.steps, [clock])
    trainer.train()
    batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    lengths = completion_lengths(trainer)
    return {"step_seconds": clock.step_seconds[warmup:], "tokens": [x * batch for x in lengths[warmup:]]}


def profile_side(side: str, overrides: list[str], work: Path, steps: int = 4) -> str:
    """A torch profiler summary of a short run of one side (after a warm-up run in the same process)."""
    from torch.profiler import ProfilerActivity, profile

    if side == "trillora":
        from trillora.trainer import Trainer

        Trainer(bench_config(2, work / "warm", overrides)).run()
        trainer = Trainer(bench_config(steps, work / "prof", overrides))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.run()
    else:
        run_trl(2, 0, overrides, work / "warm")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_trl(steps, 0, overrides, work / "prof")
    return profile_table(prof)


def child(side: str, steps: int, warmup: int, overrides: list[str], out: Path, profile: bool) -> None:
    work = Path(tempfile.mkdtemp(prefix=f"bench-{side}-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # scratch: gone when the script ends
    result = (run_trillora if side == "trillora" else run_trl)(steps, warmup, overrides, work)
    if profile:
        text = profile_side(side, overrides, work)
        (RESULTS / f"grpo_step_profile_{side}.txt").write_text(text)
    out.write_text(json.dumps(result))


def pool(runs: list[dict]) -> dict:
    """Several runs of one side as one: per-step lists joined, per-run medians (phase times) medianed."""
    return {
        k: [x for r in runs for x in r[k]] if isinstance(v, list) else statistics.median(r[k] for r in runs)
        for k, v in runs[0].items()
    }


def summarise(r: dict) -> dict:
    med = statistics.median(r["step_seconds"])
    phases = {
        k: v for k, v in r.items() if (k.endswith("_seconds") and k != "step_seconds") or k == "unaccounted_fraction"
    }
    out = {
        "median_step_seconds": med,
        "steps_per_s": 1 / med,
        "tokens_per_s": sum(r["tokens"]) / sum(r["step_seconds"]),
        **phases,
    }
    if "flops" in r:
        out["flops_per_step"] = statistics.median(r["flops"])
        out["flops_per_s"] = sum(r["flops"]) / sum(r["step_seconds"])
    return out


def ceiling(ours: dict, theirs: dict, peak: float) -> dict:
    """The step's model FLOP/s as a share of this machine's matmul peak, and the share that five times
    TRL's steps/s would need at the same FLOPs per step: how far a 5× goal sits from the ceiling."""
    return {
        "matmul_peak": peak,
        "peak_fraction": ours["flops_per_s"] / peak,
        "five_x_peak_fraction": 5 * theirs["steps_per_s"] * ours["flops_per_step"] / peak,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="times each side runs, alternating")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS / "grpo_vs_trl.json")
    p.add_argument("--side", choices=["trillora", "trl"], help=argparse.SUPPRESS)  # the child processes
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="trillora config key=value, applied to both sides")
    a = p.parse_args()
    if a.side:
        return child(a.side, a.steps, a.warmup, a.overrides, a.child_out, not a.no_profile)
    import torch
    import transformers
    import trl
    import trl_side  # noqa: F401  (quiets TRL's vLLM version warning)

    peak = matmul_peak(3, torch.device("cpu"), torch.float32)  # before the runs: an idle machine's ceiling
    runs: dict[str, list[dict]] = {"trillora": [], "trl": []}
    for round_ in range(a.rounds):  # the sides alternate, so a machine that drifts weighs on both
        for side in runs:
            out = Path(tempfile.mkdtemp()) / f"{side}.json"
            profile = not a.no_profile and round_ == a.rounds - 1
            cmd = [
                sys.executable,
                __file__,
                "--side",
                side,
                "--steps",
                str(a.steps),
                "--warmup",
                str(a.warmup),
                "--child-out",
                str(out),
                *([] if profile else ["--no-profile"]),
                *a.overrides,
            ]
            subprocess.run(cmd, check=True)
            runs[side].append(json.loads(out.read_text()))
    results = {side: summarise(pool(rs)) for side, rs in runs.items()}
    ours, theirs = results["trillora"], results["trl"]
    ceil = ceiling(ours, theirs, peak)
    table = Table(
        title=f"GRPO step, tiny MoE, same work ({a.rounds} runs × {a.steps} timed steps after {a.warmup}; median)"
    )
    for col in ("trainer", "s/step", "steps/s", "generated tokens/s", "vs TRL"):
        table.add_column(col, justify="right")
    table.add_row(
        "trillora train",
        f"{ours['median_step_seconds']:.3f}",
        f"{ours['steps_per_s']:.2f}",
        f"{ours['tokens_per_s']:,.0f}",
        f"{ours['steps_per_s'] / theirs['steps_per_s']:.2f}×",
    )
    table.add_row(
        f"TRL {trl.__version__} GRPOTrainer + PEFT",
        f"{theirs['median_step_seconds']:.3f}",
        f"{theirs['steps_per_s']:.2f}",
        f"{theirs['tokens_per_s']:,.0f}",
        "1.00×",
    )
    console = Console(width=140)
    console.print(table)
    console.print(
        f"trillora step: rollout {ours['rollout_seconds']:.3f} s + update {ours['update_seconds']:.3f} s (medians); "
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads"
    )
    console.print(
        f"trillora runs {ours['flops_per_s'] / 1e9:.0f} G model FLOP/s, {100 * ceil['peak_fraction']:.0f}% of a "
        f"2048² fp32 matmul here ({peak / 1e9:.0f} GFLOP/s); 5× TRL would need "
        f"{100 * ceil['five_x_peak_fraction']:.0f}%"
    )
    if not a.no_profile:
        console.print("profiles: benchmarks/results/grpo_step_profile_trillora.txt, grpo_step_profile_trl.txt")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {
                "steps": a.steps,
                "warmup": a.warmup,
                "rounds": a.rounds,
                "overrides": a.overrides,
                **results,
                "speedup_steps_per_s": ours["steps_per_s"] / theirs["steps_per_s"],
                "ceiling": ceil,
                "machine": machine(torch, transformers, trl),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
