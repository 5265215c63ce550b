"""Time to accuracy: `trillora train` vs TRL's GRPOTrainer + PEFT from the same checkpoint on the same
dataset and reward function (`pip install -e '.[bench]'`).

    python benchmarks/time_to_accuracy.py [--steps 120] [--eval-every 10] [--seeds 0] [--gain 0.15] [key=value ...]

The warm-started checkpoint is the shipped tiny MoE copied to an HF folder; the task is a JSONL
file of 3-digit additions (`prompt`, `answer`) and the reward `trillora.tasks.rewards:exact_match`,
given to trillora as `task.name=jsonl` and to TRL as a `datasets.Dataset` (its training rows) and a
reward function calling the same function. Training settings are the default job's for both
(`trl_side.py` maps them), at the learning rate this comparison was measured with (2e-3, the
default job's until it moved to 1e-3 for retention; a later override wins). Held-out accuracy is measured the same way
for both, with trillora's
evaluator (512 held-out rows × 2 samples at T = 1, fixed seed): inside the run for trillora, and
for TRL on its PEFT adapter saved every `--eval-every` steps and loaded into trillora's model.
Evaluation time is excluded on both sides. Reported: the time and steps each needs to gain
`--gain` (linear between evaluations), the ratio, and a PNG of accuracy against training seconds.
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

LR = "optim.lr=2e-3"

RESULTS = Path(__file__).resolve().parent / "results"
REWARD = "trillora.tasks.rewards:exact_match"


def write_dataset(path: Path, rows: int = 20_000, seed: int = 1234) -> None:
    rng, seen = random.Random(seed), set()
    with open(path, "w") as f:
        while len(seen) < rows:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            if (a, b) not in seen:
                seen.add((a, b))
                f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")


def side_args(work: Path, seed: int, steps: int, every: int, overrides: list[str]) -> list[str]:
    options = f'{{path = "{work / "addition.jsonl"}", reward_fn = "{REWARD}"}}'
    return [
        f"model.path={work / 'checkpoint'}",
        "task.name=jsonl",
        f"task.options={options}",
        'task.retention=""',
        f"seed={seed}",
        f"steps={steps}",
        f"eval_every={every}",
        f"out_dir={work}",
        f"name=trillora-{seed}",
        LR,
        *overrides,
    ]


def run_trillora(work: Path, seed: int, steps: int, every: int, overrides: list[str]) -> list[tuple[int, float, float]]:
    subprocess.run(
        [sys.executable, "-m", "trillora", "train", *side_args(work, seed, steps, every, overrides)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    rows = [json.loads(x) for x in (work / f"trillora-{seed}" / "metrics.jsonl").read_text().splitlines()]
    points, elapsed = [(0, 0.0, rows[0]["eval_accuracy"])], 0.0
    for r in rows[1:]:
        elapsed += r["step_seconds"] - r.get("eval_seconds", 0.0)
        if "eval_accuracy" in r:
            points.append((r["step"], elapsed, r["eval_accuracy"]))
    return points


def run_trl(work: Path, seed: int, steps: int, every: int, overrides: list[str]) -> list[tuple[int, float, float]]:
    from trl_side import StepClock, exact_match_reward, make_trainer

    from trillora import lora
    from trillora.config import load_config
    from trillora.tasks.base import in_eval_split
    from trillora.trainer import Trainer

    cfg = load_config(None, side_args(work, seed, steps, every, overrides))
    judge = Trainer(cfg)  # trillora's model, engine and held-out problems, used only to evaluate TRL's adapters
    rows = [json.loads(x) for x in (work / "addition.jsonl").read_text().splitlines()]
    train_rows = [
        {"prompt": "<bos>" + r["prompt"], "answer": r["answer"]}
        for r in rows
        if not in_eval_split(r["prompt"], judge.task.eval_fraction)
    ]

    def evaluate(model) -> float:
        folder = Path(tempfile.mkdtemp(prefix="trl-adapter-"))
        model.save_pretrained(folder)  # PEFT format: gate_up_proj / down_proj through target_parameters
        lora.load_adapter(judge.model, folder)
        judge.sync_engine()
        shutil.rmtree(folder)
        return judge.evaluate(judge.task, judge.eval_problems)

    clock = StepClock(evaluate, every)
    make_trainer(cfg, train_rows, exact_match_reward, work / f"trl-{seed}", steps, [clock]).train()
    return clock.points


def time_to_gain(points: list[tuple[int, float, float]], gain: float) -> tuple[float, float]:
    """(seconds, steps) at which accuracy first reaches start + gain, linear between evaluations; nan if never."""
    target = points[0][2] + gain
    for (s0, t0, a0), (s1, t1, a1) in itertools.pairwise(points):
        if a1 >= target:
            f = (target - a0) / (a1 - a0) if a1 > a0 else 1.0
            return t0 + f * (t1 - t0), s0 + f * (s1 - s0)
    return float("nan"), float("nan")


def plot(
    curves: dict[str, list[list[tuple[int, float, float]]]], names: dict[str, str], gain: float, path: Path
) -> None:
    """Accuracy gained over each run's own start against training seconds, every run of both sides."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (side, runs), color in zip(curves.items(), ("tab:blue", "tab:orange"), strict=True):
        for i, pts in enumerate(runs):
            ax.plot(
                [t for _, t, _ in pts],
                [100 * (a - pts[0][2]) for _, _, a in pts],
                marker="o",
                ms=3,
                color=color,
                label=names[side] if i == 0 else None,
            )
    ax.axhline(100 * gain, color="gray", ls="--", lw=1, label=f"+{100 * gain:.0f} points")
    ax.set_xlabel("training wall-clock (s), evaluation excluded")
    ax.set_ylabel("held-out accuracy gained (points)")
    ax.set_title("3-digit addition, tiny MoE, LoRA GRPO: time to accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--gain", type=float, default=0.15)
    p.add_argument("--out", type=Path, default=RESULTS / "time_to_accuracy.json")
    p.add_argument("--side", choices=["trillora", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="trillora config key=value, applied to both sides")
    a = p.parse_args()
    if a.side:  # a child process: one side, one seed
        run = run_trillora if a.side == "trillora" else run_trl
        points = run(a.work, a.seed, a.steps, a.eval_every, a.overrides)
        (a.work / f"{a.side}-{a.seed}.json").write_text(json.dumps(points))
        return
    import trl
    import trl_side  # noqa: F401  (quiets TRL's vLLM version warning)

    from trillora.checkpoint import resolve_model_path

    work = Path(tempfile.mkdtemp(prefix="time-to-accuracy-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # scratch: gone when the script ends
    shutil.copytree(resolve_model_path("tiny-moe"), work / "checkpoint")
    write_dataset(work / "addition.jsonl")
    curves: dict[str, list] = {"trillora": [], "trl": []}
    for seed in a.seeds:
        for side in curves:
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--side",
                    side,
                    "--work",
                    str(work),
                    "--seed",
                    str(seed),
                    "--steps",
                    str(a.steps),
                    "--eval-every",
                    str(a.eval_every),
                    *a.overrides,
                ],
                check=True,
            )
            curves[side].append(json.loads((work / f"{side}-{seed}.json").read_text()))
    table = Table(title=f"time to +{100 * a.gain:.0f} points of held-out accuracy (seeds {a.seeds})")
    for col in (
        "trainer",
        "seed",
        "start",
        f"after {a.steps} steps",
        "best",
        "steps to gain",
        "seconds to gain",
        "s/step",
    ):
        table.add_column(col, justify="right")
    summary = {}
    names = {"trillora": "trillora train", "trl": f"TRL {trl.__version__} GRPOTrainer + PEFT"}
    for side, runs in curves.items():
        name = names[side]
        summary[side] = []
        for seed, pts in zip(a.seeds, runs, strict=True):
            sec, steps = time_to_gain(pts, a.gain)
            per_step = pts[-1][1] / pts[-1][0]
            summary[side].append({"seed": seed, "points": pts, "seconds_to_gain": sec, "steps_to_gain": steps})
            table.add_row(
                name,
                str(seed),
                f"{100 * pts[0][2]:.1f}%",
                f"{100 * pts[-1][2]:.1f}%",
                f"{100 * max(x for _, _, x in pts):.1f}%",
                f"{steps:.0f}",
                f"{sec:.1f}",
                f"{per_step:.3f}",
            )
    console = Console(width=150)
    console.print(table)
    ours = [r["seconds_to_gain"] for r in summary["trillora"]]
    theirs = [r["seconds_to_gain"] for r in summary["trl"]]
    ratio = sum(ours) / sum(theirs) if all(x == x for x in ours + theirs) else float("nan")
    console.print(
        f"trillora's time to +{100 * a.gain:.0f} points = {ratio:.2f}× TRL's (summed over seeds; nan: a side never "
        f"got there)"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    png = a.out.with_suffix(".png")
    plot(curves, names, a.gain, png)
    console.print(f"plot: {png}")
    a.out.write_text(
        json.dumps(
            {
                "steps": a.steps,
                "eval_every": a.eval_every,
                "gain": a.gain,
                "overrides": a.overrides,
                "ratio_time_to_gain": ratio,
                **summary,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
