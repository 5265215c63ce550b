"""Router replay on the tiny MoE: `algorithm.router_replay` off vs all (R3), same seeds.

    python benchmarks/router_replay.py [--steps 100] [--seeds 0 1 2] [key=value ...]

Each run is the default job (bf16-rounded rollout weights, fp32 trainer, token TIS) with the
routing recorded at rollout (`algorithm.routing_metrics=true`, so both modes log how often the
trainer's router disagrees with the rollout's); `all` replays the recorded experts in every
training pass. Reported per mode, averaged over seeds: train reward over the last 20 steps,
held-out accuracy at the end, mismatch KL (k3) between rollout and trainer logprobs (mean and largest step), the
fraction
of tokens routed differently. Writes benchmarks/results/router_replay.{json,png}.
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

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("off", "all")


def run(work: Path, mode: str, seed: int, steps: int, overrides: list[str]) -> list[dict]:
    name = f"{mode}-{seed}"
    args = [
        f"out_dir={work}",
        f"name={name}",
        f"seed={seed}",
        f"steps={steps}",
        f"eval_every={steps}",
        f'algorithm.router_replay="{mode}"',
        "algorithm.routing_metrics=true",
        *overrides,
    ]
    subprocess.run([sys.executable, "-m", "trillora", "train", *args], check=True, stdout=subprocess.DEVNULL)
    return [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]


def mean_of(rows: list[dict], key: str, last: int | None = None) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values[-last:] if last else values)


def plot(curves: dict[str, list[list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    panels = (
        ("reward_mean", "train reward"),
        ("mismatch_kl_k3", "rollout vs trainer KL (k3)"),
        ("routing_mismatch", "tokens routed differently"),
    )
    for (key, title), ax in zip(panels, axes, strict=True):
        for (mode, runs), color in zip(curves.items(), ("tab:orange", "tab:blue"), strict=True):
            for i, rows in enumerate(runs):
                pts = [(r["step"], r[key]) for r in rows if key in r]
                ax.plot(
                    *zip(*pts, strict=True),
                    color=color,
                    alpha=0.7,
                    lw=1,
                    label=f"router_replay={mode}" if i == 0 else None,
                )
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=RESULTS / "router_replay.json")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="router-replay-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # scratch: gone when the script ends
    curves: dict[str, list[list[dict]]] = {m: [] for m in MODES}
    console = Console(width=140)
    with console.status("training") as status:
        for seed in a.seeds:
            for mode in MODES:
                status.update(f"router_replay={mode}, seed {seed}")
                curves[mode].append(run(work, mode, seed, a.steps, a.overrides))
    table = Table(title=f"router replay on the tiny MoE, {a.steps} steps, seeds {a.seeds} (means over seeds)")
    for col in (
        "router_replay",
        "reward, last 20 steps",
        "held-out accuracy at the end",
        "mismatch KL k3",
        "tokens routed differently",
    ):
        table.add_column(col, justify="right")
    summary = {}
    for mode, runs in curves.items():
        s = {
            "reward_last20": statistics.fmean(mean_of(r, "reward_mean", 20) for r in runs),
            "eval_accuracy": statistics.fmean(r[-1]["eval_accuracy"] for r in runs),
            "eval_accuracy_per_seed": [r[-1]["eval_accuracy"] for r in runs],
            "mismatch_kl_k3": statistics.fmean(mean_of(r, "mismatch_kl_k3") for r in runs),
            "mismatch_kl_k3_max": max(x["mismatch_kl_k3"] for r in runs for x in r if "mismatch_kl_k3" in x),
            "routing_mismatch": statistics.fmean(mean_of(r, "routing_mismatch") for r in runs),
        }
        summary[mode] = s
        table.add_row(
            mode,
            f"{s['reward_last20']:.3f}",
            f"{100 * s['eval_accuracy']:.1f}% ({', '.join(f'{100 * x:.1f}' for x in s['eval_accuracy_per_seed'])})",
            f"{s['mismatch_kl_k3']:.2e} (max {s['mismatch_kl_k3_max']:.1e})",
            f"{100 * s['routing_mismatch']:.2f}%",
        )
    console.print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(curves, a.out.with_suffix(".png"))
    a.out.write_text(json.dumps({"steps": a.steps, "seeds": a.seeds, "overrides": a.overrides, **summary}, indent=2))
    console.print(f"plot: {a.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
