"""Asynchronous vs synchronous rollouts: wall-clock per 100 samples of `trillora train`, same job.

    python benchmarks/async_rollout.py [--steps 30] [--warmup 3] [--rounds 2] [--staleness 1] [key=value ...]

The default job (tiny MoE, 32 prompts × 8 samples a step) with `rollout.asynchronous=false` and
`true` (`rollout.max_staleness`), each in its own process, alternating for `--rounds`; per run,
the seconds of the steps after `--warmup` (evaluation excluded) per 100 completions, then the
median over runs. Also reported: the staleness the asynchronous runs actually had.
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
import tomllib
from pathlib import Path

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parent / "results"


def run(work: Path, name: str, steps: int, warmup: int, overrides: list[str]) -> tuple[float, list[float]]:
    args = [
        f"out_dir={work}",
        f"name={name}",
        f"steps={steps}",
        f"eval_every={steps}",
        'task.retention=""',
        "task.eval_problems=16",
        *overrides,
    ]
    subprocess.run([sys.executable, "-m", "trillora", "train", *args], check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()][1:]
    rollout = tomllib.loads((work / name / "config.toml").read_text())["rollout"]
    per_step = rollout["prompts_per_step"] * rollout["group_size"]
    timed = [r for r in rows if r["step"] > warmup]
    seconds = sum(r["step_seconds"] - r.get("eval_seconds", 0.0) for r in timed)
    return 100 * seconds / (per_step * len(timed)), [r.get("staleness", 0.0) for r in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "async_rollout.json")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="async-rollout-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # scratch: gone when the script ends
    modes = {
        "synchronous": ["rollout.asynchronous=false"],
        f"asynchronous, staleness ≤ {a.staleness}": [
            "rollout.asynchronous=true",
            f"rollout.max_staleness={a.staleness}",
        ],
    }
    per100: dict[str, list[float]] = {m: [] for m in modes}
    staleness: list[float] = []
    console = Console(width=120)
    with console.status("training") as status:
        for i in range(a.rounds):
            for j, (mode, extra) in enumerate(modes.items()):
                status.update(f"{mode}, run {i + 1}")
                sec, stale = run(work, f"{j}-{i}", a.steps, a.warmup, [*extra, *a.overrides])
                per100[mode].append(sec)
                staleness += stale if j == 1 else []
    sync = statistics.median(per100["synchronous"])
    table = Table(title=f"seconds per 100 samples, {a.rounds} runs × {a.steps - a.warmup} timed steps (median)")
    for col in ("rollouts", "s / 100 samples", "runs", "vs synchronous"):
        table.add_column(col, justify="right")
    for mode, values in per100.items():
        med = statistics.median(values)
        table.add_row(mode, f"{med:.3f}", ", ".join(f"{v:.3f}" for v in values), f"{med / sync:.2f}×")
    console.print(table)
    console.print(
        f"staleness of the asynchronous steps: max {max(staleness):.0f}, mean {statistics.fmean(staleness):.2f}"
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {
                "steps": a.steps,
                "warmup": a.warmup,
                "rounds": a.rounds,
                "per_100_samples": per100,
                "staleness_max": max(staleness),
                "staleness_mean": statistics.fmean(staleness),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
