"""tinker-cookbook's own loops against `serve --tinker` on tiny-moe-chat: does the RL reward rise?

    python benchmarks/cookbook_reward.py [--sl-steps 128] [--rl-steps 80] [--rl-lr 5e-4]

One `trillora serve tiny-moe-chat --tinker` (in this process, on loopback) and the cookbook's
`sl_loop` then `rl_loop`, unchanged, as subprocesses through `examples/tinker_cookbook_tiny.py`
(the commands the README shows, at the sizes given here): supervised on 3-digit addition in the
RL loop's chat format, then GRPO-style RL (importance_sampling) on held-apart additions from the
supervised run's final state. Reported: the supervised NLL curve and the RL reward per step, the
mean reward of the first and last `--window` steps. RL at the supervised run's 2e-3 collapsed
(reward 0.35 at its first step, 0.00 over the last 10 of 40); at 5e-4 it rises. Writes
benchmarks/results/cookbook_reward.json
and cookbook_reward.png.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
EXAMPLE = ROOT / "examples" / "tinker_cookbook_tiny.py"
KEY = "tml-cookbook-bench"


def run_recipe(port: int, which: str, args: list[str]) -> float:
    env = {
        **os.environ,
        "TINKER_API_KEY": KEY,
        "TINKER_BASE_URL": f"http://127.0.0.1:{port}",
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    start = time.perf_counter()
    out = subprocess.run([sys.executable, str(EXAMPLE), which, *args], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the cookbook's {which} loop failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return time.perf_counter() - start


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(report["sl"]["nll"])
    a.set(xlabel="supervised step", ylabel="train mean NLL", title="cookbook sl_loop")
    b.plot(report["rl"]["reward"], marker=".")
    b.set(xlabel="RL step", ylabel="mean reward (exact \\boxed{} answer)", title="cookbook rl_loop", ylim=(0, 1))
    fig.suptitle("tinker-cookbook against trillora serve --tinker (tiny-moe-chat, 3-digit addition)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    from rich.console import Console

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tinker_clients import start_server

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sl-steps", type=int, default=128)
    p.add_argument("--sl-batch", type=int, default=32)
    p.add_argument("--sl-lr", type=float, default=3e-3)
    p.add_argument("--rl-steps", type=int, default=80)
    p.add_argument("--rl-batch", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--rl-lr", type=float, default=5e-4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--out", default=str(RESULTS / "cookbook_reward.json"))
    args = p.parse_args(argv)
    console = Console()
    work = Path(tempfile.mkdtemp(prefix="cookbook-bench-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # scratch: gone when the script ends
    server = start_server("tiny-moe-chat", str(work / "state"), api_key=KEY)
    sl, rl = work / "sl", work / "rl"
    console.print(f"supervised loop: {args.sl_steps} steps × {args.sl_batch} ...")
    sl_seconds = run_recipe(
        server.cfg.port,
        "sl",
        [
            f"log_path={sl}",
            f"batch_size={args.sl_batch}",
            f"max_steps={args.sl_steps}",
            f"learning_rate={args.sl_lr}",
            "save_every=0",
        ],
    )
    console.print(f"RL loop: {args.rl_steps} steps × {args.rl_batch} prompts × {args.group} samples ...")
    rl_seconds = run_recipe(
        server.cfg.port,
        "rl",
        [
            f"log_path={rl}",
            f"start_from={sl}",
            f"batch_size={args.rl_batch}",
            f"group_size={args.group}",
            f"max_tokens={args.max_tokens}",
            f"max_steps={args.rl_steps}",
            f"learning_rate={args.rl_lr}",
            "loss_fn=importance_sampling",
            "save_every=0",
        ],
    )
    server.stop()
    nll = [m["train_mean_nll"] for m in rows(sl / "metrics.jsonl")]
    reward = [m["reward/total"] for m in rows(rl / "metrics.jsonl")]
    w = min(args.window, len(reward) // 2) or 1
    report = {
        "command": "python benchmarks/cookbook_reward.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": "tiny-moe-chat",
        "settings": vars(args) | {"out": None},
        "sl": {"seconds": sl_seconds, "nll": nll},
        "rl": {
            "seconds": rl_seconds,
            "reward": reward,
            "first_mean": sum(reward[:w]) / w,
            "last_mean": sum(reward[-w:]) / w,
            "window": w,
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    console.print(
        f"supervised NLL {nll[0]:.2f} → {nll[-1]:.2f} ({sl_seconds:.0f} s); RL reward, mean of the first {w} "
        f"steps {report['rl']['first_mean']:.3f} → last {w} {report['rl']['last_mean']:.3f} ({rl_seconds:.0f} s)"
    )
    return report


if __name__ == "__main__":
    main()
