"""Agentic RL on the shipped models: the calculator tool env and the guessing game, from their example configs.

    python benchmarks/agent_envs.py [--only calculator guessing] [key=value ...]

Each runs `trillora train examples/<env>.toml` as written (overrides apply to both). Reported per
env: held-out success before and after (the mean return of held-out episodes, sampled at the
rollout temperature), the gain in points, the seconds of RL (steps, evaluation excluded) and of
the whole run, and per episode at the start and the end: turns, tool calls, parse errors.
Writes benchmarks/results/agent_envs.{json,png}.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ENVS = ("calculator", "guessing")
CURVES = (
    ("eval_accuracy", "held-out success"),
    ("turns_mean", "turns per episode"),
    ("env/tool_calls", "tool calls per episode"),
    ("env/parse_error", "parse errors per episode"),
)


def run(work: Path, env: str, overrides: list[str]) -> tuple[list[dict], float]:
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "trillora",
            "train",
            str(ROOT / "examples" / f"{env}.toml"),
            f"out_dir={work}",
            f"name={env}",
            *overrides,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        cwd=ROOT,
    )
    wall = time.perf_counter() - start
    return [json.loads(x) for x in (work / env / "metrics.jsonl").read_text().splitlines()], wall


def summarize(rows: list[dict], wall: float) -> dict:
    evals = [r for r in rows if "eval_accuracy" in r]
    steps = [r for r in rows if "step_seconds" in r]
    rl = sum(r["step_seconds"] - r.get("eval_seconds", 0.0) for r in steps)

    def ends(key: str) -> list[float | None]:
        values = [r[key] for r in steps if key in r]
        k = max(1, len(values) // 10)  # the first and the last tenth of the run
        return [sum(values[:k]) / k, sum(values[-k:]) / k] if values else [None, None]

    return {
        "steps": len(steps),
        "success_before": evals[0]["eval_accuracy"],
        "success_after": evals[-1]["eval_accuracy"],
        "gain_points": 100 * (evals[-1]["eval_accuracy"] - evals[0]["eval_accuracy"]),
        "rl_seconds": rl,
        "wall_seconds": wall,
        **{f"{k}_start_end": ends(k) for k, _ in CURVES[1:]},
    }


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(16, 3.6))
    for (key, title), ax in zip(CURVES, axes, strict=True):
        for env, rows in curves.items():
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o" if key == "eval_accuracy" else None, label=env)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", choices=ENVS, default=list(ENVS))
    p.add_argument("--out", type=Path, default=RESULTS / "agent_envs.json")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="agent-envs-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # scratch: gone when the script ends
    curves, results = {}, {}
    for env in a.only:
        rows, wall = run(work, env, a.overrides)
        curves[env], results[env] = rows, summarize(rows, wall)
    table = Table(title="agentic RL from the example configs (held-out success, sampled)")
    for col in (
        "env",
        "steps",
        "before",
        "after",
        "gain (points)",
        "RL seconds",
        "wall seconds",
        "tool calls / ep",
        "turns / ep",
    ):
        table.add_column(col)
    for env, r in results.items():
        calls, turns = r["env/tool_calls_start_end"], r["turns_mean_start_end"]
        table.add_row(
            env,
            str(r["steps"]),
            f"{r['success_before']:.3f}",
            f"{r['success_after']:.3f}",
            f"{r['gain_points']:+.1f}",
            f"{r['rl_seconds']:.0f}",
            f"{r['wall_seconds']:.0f}",
            "-" if calls[0] is None else f"{calls[0]:.2f} → {calls[1]:.2f}",
            f"{turns[0]:.2f} → {turns[1]:.2f}",
        )
    Console().print(table)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(
        json.dumps(
            {
                "command": "python benchmarks/agent_envs.py " + " ".join(sys.argv[1:]),
                "results": results,
                "curves": {k: v for k, v in curves.items()},
            },
            indent=1,
        )
        + "\n"
    )
    plot(curves, a.out.with_suffix(".png"))
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
