"""tinker-cookbook's full supervised trainer with rolling checkpoints: does any step stall?

    python benchmarks/cookbook_checkpoints.py [--steps 24] [--batch 16] [--save-every 4]

One `trillora serve tiny-moe-chat --tinker` (in this process, on loopback) and the cookbook's
`supervised/train.py`, unchanged, as a subprocess through `examples/tinker_cookbook_tiny.py train`.
Arms, one after the other on the same server:

- "no checkpoints": `save_every=0`;
- "rolling + periodic": a rolling checkpoint every step (each save deletes the one before, a DELETE)
  and a periodic one every `--save-every` steps with a TTL (a PUT on the checkpoint).

Both with `submit_ahead=0`, so a step's time is its own: the cookbook's default (1) submits the next
batch before finishing this one, and a save then waits behind the next step's work, which moves
time from one step to the next without adding any. The default is run too, for its total.
A step's seconds are the cookbook's own spans: get_batch + submit_batch + finish_batch (the saves
run inside finish_batch). Before the checkpoint routes were served, one such step took 357 s
(the SDK retrying the 501 it got for DELETE). Reported per arm: median and largest step, their
ratio, total seconds; and what the store holds afterwards. Writes
benchmarks/results/cookbook_checkpoints.json and cookbook_checkpoints.png.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SPANS = ("time/get_batch", "time/submit_batch", "time/finish_batch")


def step_seconds(metrics: list[dict]) -> list[float]:
    """Each step's wall time as the cookbook measures its parts (the saves are inside finish_batch)."""
    return [sum(m.get(k, 0.0) for k in SPANS) for m in metrics]


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, arm in report["arms"].items():
        ax.plot(arm["step_seconds"], marker=".", label=f"{name} (largest / median {arm['largest_over_median']:.2f})")
    median = report["arms"]["rolling + periodic"]["median_s"]
    ax.axhline(2 * median, color="grey", ls="--", lw=1, label="2 × median (rolling + periodic)")
    ax.set(
        xlabel="step",
        ylabel="seconds",
        ylim=(0, None),
        title="cookbook supervised/train.py against serve --tinker: seconds per step",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    from rich.console import Console
    from rich.table import Table

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from cookbook_reward import KEY, rows, run_recipe
    from tinker_clients import start_server

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--ttl-seconds", type=int, default=3600)
    p.add_argument("--out", default=str(RESULTS / "cookbook_checkpoints.json"))
    args = p.parse_args(argv)
    console = Console()

    work = Path(tempfile.mkdtemp(prefix="cookbook-ckpt-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # scratch: gone when the script ends
    server = start_server("tiny-moe-chat", str(work / "state"), api_key=KEY)
    common = [f"batch_size={args.batch}", f"max_steps={args.steps}", "learning_rate=3e-3", "lora_rank=8"]
    saving = [f"save_every={args.save_every}", "rolling_save_every=1", f"ttl_seconds={args.ttl_seconds}"]
    arms = {
        "no checkpoints": ["save_every=0", "submit_ahead=0"],
        "rolling + periodic": saving + ["submit_ahead=0"],
        "rolling + periodic, submit_ahead=1": saving,
    }
    report: dict = {
        "command": "python benchmarks/cookbook_checkpoints.py " + " ".join(argv or []),
        "model": "tiny-moe-chat",
        "steps": args.steps,
        "batch": args.batch,
        "save_every": args.save_every,
        "arms": {},
    }
    try:
        for name, extra in arms.items():
            log = work / name.replace(" ", "_").replace(",", "").replace("+", "and")
            console.print(f"[bold]{name}[/]: {args.steps} steps of the cookbook's supervised trainer")
            start = time.perf_counter()
            run_recipe(server.cfg.port, "train", [f"log_path={log}", *common, *extra])
            wall = time.perf_counter() - start
            seconds = step_seconds(rows(log / "metrics.jsonl"))
            median = statistics.median(seconds)
            arm = {
                "step_seconds": seconds,
                "median_s": median,
                "largest_s": max(seconds),
                "largest_over_median": max(seconds) / median,
                "steps_s": sum(seconds),
                "process_s": wall,
            }
            if "rolling_save_every=1" in extra:
                saved = rows(log / "checkpoints.jsonl")
                run = saved[-1]["state_path"].split("/")[2]
                left = {c["tinker_path"]: c for c in server.tinker.store.checkpoints(run)}
                rolling = [r["state_path"] for r in saved if not r.get("sampler_path")]
                arm.update(
                    checkpoints_saved=len(saved),
                    rolling_saved=len(rolling),
                    rolling_left=len(set(rolling) & set(left)),
                    with_expiry=sum(c["expires_at"] is not None for c in left.values()),
                )
            report["arms"][name] = arm
    finally:
        server.stop()

    none, saving_arm = report["arms"]["no checkpoints"], report["arms"]["rolling + periodic"]
    report["checkpointing_cost"] = saving_arm["steps_s"] / none["steps_s"]
    table = Table(title=f"cookbook supervised/train.py, {args.steps} steps × {args.batch} rows, tiny-moe-chat")
    for col in ("arm", "median step s", "largest step s", "largest / median", "steps total s", "rolling left"):
        table.add_column(col)
    for name, arm in report["arms"].items():
        table.add_row(
            name,
            f"{arm['median_s']:.3f}",
            f"{arm['largest_s']:.3f}",
            f"{arm['largest_over_median']:.2f}×",
            f"{arm['steps_s']:.1f}",
            str(arm.get("rolling_left", "-")),
        )
    console.print(table)
    console.print(f"checkpointing costs {report['checkpointing_cost']:.2f}× the steps' time without it")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    console.print(f"wrote {out} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
