"""The default job (`make demo`, `trillora train`) on several seeds: what RL gains and what it keeps.

    python benchmarks/default_job.py [--seeds 0 1 2] [--modes off all] [key=value ...]

Each seed runs `trillora train seed=N` as written, in its own process, once per
`algorithm.router_replay` mode (`off`, the default; `all` routes every training pass to the
experts the rollout chose, which also runs whole rows instead of shared prompts). Reported per
run: held-out 3-digit addition before and after RL and held-out string reversal (retention)
before and after, both sampled at T=1 over 1024 samples, and the run's wall-clock seconds; and
the machine, whose CPU decides the fp32 rounding and so the sampled trajectories. Writes
benchmarks/results/default_job.json and copies the seed-0 default run's overview plot to
docs/demo_overview.png.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from machine import machine
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def run(work: Path, seed: int, mode: str, overrides: list[str]) -> dict:
    name = f"{mode}-seed{seed}"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "trillora",
            "train",
            f"out_dir={work}",
            f"name={name}",
            f"seed={seed}",
            f'algorithm.router_replay="{mode}"',
            *overrides,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    s = json.loads((work / name / "summary.json").read_text())
    return {
        "seed": seed,
        "mode": mode,
        "addition_before": s["eval_before"],
        "addition_after": s["eval_after"],
        "gain_points": 100 * (s["eval_after"] - s["eval_before"]),
        "retention_before": s["retention_before"],
        "retention_after": s["retention_after"],
        "retention_lost_points": 100 * (s["retention_before"] - s["retention_after"]),
        "seconds": s["seconds"],
        "run_dir": name,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--modes", nargs="+", default=["off", "all"])
    p.add_argument("--out", type=Path, default=RESULTS / "default_job.json")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="trainings at once (each keeps torch's thread count, so the "
        "numbers are those of one at a time; only the seconds change)",
    )
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="default-job-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # scratch: gone when the script ends
    console = Console(width=120)
    todo = [(seed, mode) for mode in a.modes for seed in a.seeds]
    with console.status(f"training {len(todo)} runs, {a.jobs} at a time"), ThreadPoolExecutor(a.jobs) as pool:
        rows = list(pool.map(lambda job: run(work, *job, a.overrides), todo))
    table = Table(title="the default job: held-out addition gained, held-out reversal kept (T=1, 1024 samples)")
    for col in (
        "router_replay",
        "seed",
        "addition before → after",
        "gain",
        "reversal before → after",
        "lost",
        "seconds",
    ):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["mode"],
            str(r["seed"]),
            f"{r['addition_before']:.1%} → {r['addition_after']:.1%}",
            f"{r['gain_points']:+.1f}",
            f"{r['retention_before']:.1%} → {r['retention_after']:.1%}",
            f"{r['retention_lost_points']:.1f}",
            f"{r['seconds']:.0f}",
        )
    console.print(table)
    report = {
        "command": " ".join(["python benchmarks/default_job.py", *(sys.argv[1:] if argv is None else argv)]),
        "runs": rows,
        # fp32 rounding differs between CPUs, so the sampled trajectories (and these figures) do too
        "machine": machine(torch),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    first = next((r for r in rows if r["mode"] == a.modes[0] and r["seed"] == a.seeds[0]), None)
    if first is not None and a.out == RESULTS / "default_job.json":
        shutil.copy(work / first["run_dir"] / "overview.png", ROOT / "docs" / "demo_overview.png")
    return report


if __name__ == "__main__":
    main()
