"""Compute-matched RL: a larger model trained through LoRA against smaller ones trained in full,
every arm stopped at the same total FLOPs (sampling and training, `flops_total`).

    python -m trillora.tiny build-family runs/family            # w64, w128, w256 (0.26M, 1M, 4M)
    python benchmarks/compute_matched.py --family runs/family [--flops 4e12] [--seeds 0 1 2] [--jobs 2]

Arms (`--arms`, width:mode): by default every width of the family trained in full and with a
rank-8 LoRA, and the widest also at LoRA ranks 1 and 64 (the rank axis at equal compute). Each
arm is `trillora train` on the default job's task (held-out 3-digit addition, reversal as
retention) with `flops_budget` = `--flops` and `model.path` the family member; LoRA arms use the
default `optim.lr`, full arms `--full-lr` (full-parameter updates move every weight: a LoRA
learning rate wrecks the model). The held-out sets are sampled at T=1 about `--evals` times per
run, at equal FLOP intervals (a one-step probe of each arm measures its FLOPs per step), so each
run gives accuracy and retention against cumulative FLOPs. Writes
benchmarks/results/compute_matched.json and a PNG of the curves (mean over seeds, min-max band).
"""

from __future__ import annotations

import argparse
import atexit
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def default_arms(family: Path) -> list[str]:
    widths = sorted(int(p.name[1:]) for p in family.glob("w*") if (p / "config.json").is_file())
    if not widths:
        raise SystemExit(f"{family} holds no w<width>/ checkpoints: python -m trillora.tiny build-family {family}")
    return [f"w{w}:{mode}" for w in widths for mode in ("full", "lora8")] + [f"w{widths[-1]}:lora{r}" for r in (1, 64)]


def overrides_of(arm: str, family: Path, full_lr: float) -> list[str]:
    """`w256:lora8`, `w64:full`, or either with its own learning rate (`w128:full:3e-4`)."""
    member, mode, *lr = arm.split(":")
    if not (family / member / "config.json").is_file():
        raise SystemExit(f"arm {arm!r}: no checkpoint {family / member}")
    try:
        lr = [f"optim.lr={float(lr[0])}"] if lr else []
    except ValueError:
        raise SystemExit(f"arm {arm!r}: the part after the mode is a learning rate") from None
    if mode == "full":
        return [f"model.path={family / member}", "finetune=full", *(lr or [f"optim.lr={full_lr}"])]
    if not mode.startswith("lora") or not mode[4:].isdigit():
        raise SystemExit(f"arm {arm!r}: the mode after ':' is full or lora<rank>")
    rank = int(mode[4:])
    return [f"model.path={family / member}", f"lora.rank={rank}", f"lora.alpha={2 * rank}", *lr]


def train(work: Path, name: str, arm: str, a, *settings: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "trillora",
        "train",
        f"out_dir={work}",
        f"name={name}",
        *overrides_of(arm, a.family, a.full_lr),
        *a.overrides,
        *settings,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")


def eval_every(work: Path, arm: str, a) -> int:
    """Steps between evaluations for ~`a.evals` of them within the budget, from one probe step."""
    name = f"probe-{arm.replace(':', '-')}"
    train(work, name, arm, a, "steps=1", "eval_every=1", "task.eval_problems=1", 'task.retention=""')
    per_step = json.loads((work / name / "summary.json").read_text())["flops_total"]
    return max(1, round(a.flops / per_step / a.evals))


def run(work: Path, arm: str, seed: int, every: int, a) -> dict:
    name = f"{arm.replace(':', '-')}-seed{seed}"
    train(
        work,
        name,
        arm,
        a,
        f"seed={seed}",
        "steps=100000",
        f"flops_budget={a.flops}",
        f"eval_every={every}",
        f"task.eval_problems={a.eval_problems}",
    )
    rows = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
    curve = [
        {
            "flops": r.get("flops_total", 0.0),
            "step": r["step"],
            "accuracy": r["eval_accuracy"],
            "retention": r.get("retention_accuracy"),
        }
        for r in rows
        if "eval_accuracy" in r
    ]
    s = json.loads((work / name / "summary.json").read_text())
    return {
        "arm": arm,
        "seed": seed,
        "steps": s["steps_done"],
        "flops": s["flops_total"],
        "seconds": s["seconds"],
        "trained_params": s["adapter"]["adapter_params"] if s["finetune"] == "lora" else s["adapter"]["base_params"],
        "accuracy_before": s["eval_before"],
        "accuracy_after": s["eval_after"],
        "retention_before": s["retention_before"],
        "retention_after": s["retention_after"],
        "curve": curve,
    }


def summarize(runs: list[dict]) -> list[dict]:
    out = []
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        after = [r["accuracy_after"] for r in mine]
        kept = [r["retention_after"] for r in mine if r["retention_after"] is not None]
        out.append(
            {
                "arm": arm,
                "seeds": len(mine),
                "accuracy_before": statistics.fmean(r["accuracy_before"] for r in mine),
                "accuracy_after": statistics.fmean(after),
                "accuracy_min": min(after),
                "accuracy_max": max(after),
                "retention_after": statistics.fmean(kept) if kept else None,
                "steps": statistics.fmean(r["steps"] for r in mine),
                "trained_params": mine[0]["trained_params"],
            }
        )
    return out


def task_label(task: str, command: str) -> str:
    """The task's name for titles and axes: an env dataset by its module (`guessing`)."""
    found = re.search(r'env\s*=\s*"?([\w.]+):', command) if task == "env" else None
    return found.group(1).rsplit(".", 1)[-1] if found else task


def plot(runs: list[dict], task: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    colors = plt.cm.tab20(range(len(arms)))
    for arm, color in zip(arms, colors, strict=True):
        curves = [r["curve"] for r in runs if r["arm"] == arm]
        at = list(range(min(len(c) for c in curves) - 1)) + [-1]  # seeds share the cadence; each ends at its last
        x = [statistics.fmean(c[i]["flops"] for c in curves) for i in at]
        ys = [[c[i]["accuracy"] for c in curves] for i in at]
        (line,) = ax.plot(
            x,
            [statistics.fmean(y) for y in ys],
            marker="o",
            ms=3,
            label=arm,
            color=color,
            ls="--" if ":full" in arm else "-",
        )  # dashed: full-parameter
        ax.fill_between(x, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.15)
    ax.set_xlabel("cumulative FLOPs (sampling + training)")
    ax.set_ylabel(f"held-out {task} (T=1)")
    ax.set_title("RL at equal compute: model width × LoRA rank / full")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", type=Path, help="the family's folder (python -m trillora.tiny build-family)")
    p.add_argument("--arms", nargs="+", default=None, help="width:mode, e.g. w256:lora8 w64:full")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--flops", type=float, default=4e12, help="each run's FLOP budget")
    p.add_argument("--full-lr", type=float, default=1e-4)
    p.add_argument("--evals", type=int, default=10, help="held-out evaluations per run (plus before and at the end)")
    p.add_argument("--eval-problems", type=int, default=256)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "compute_matched.json")
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG of --out without training")
    p.add_argument("overrides", nargs="*", help="key=value for every run")
    a = p.parse_args(argv)
    task = next((o.split("=", 1)[1] for o in reversed(a.overrides) if o.startswith("task.name=")), "arithmetic")
    if a.plot_only:
        report = json.loads(a.out.read_text())
        plot(report["runs"], task_label(report.get("task", task), report["command"]), a.out.with_suffix(".png"))
        return report
    if a.family is None:
        p.error("--family is required (the folder python -m trillora.tiny build-family wrote)")
    arms = a.arms or default_arms(a.family)
    for arm in arms:
        overrides_of(arm, a.family, a.full_lr)  # a bad arm fails before any training
    work = Path(tempfile.mkdtemp(prefix="compute-matched-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # scratch: gone when the script ends
    console = Console(width=140)
    with console.status(f"probing {len(arms)} arms"), ThreadPoolExecutor(a.jobs) as pool:
        every = dict(zip(arms, pool.map(lambda arm: eval_every(work, arm, a), arms), strict=True))
    todo = [(arm, seed) for arm in arms for seed in a.seeds]
    with (
        console.status(f"training {len(todo)} runs to {a.flops:.2g} FLOPs each, {a.jobs} at a time"),
        ThreadPoolExecutor(a.jobs) as pool,
    ):
        runs = list(pool.map(lambda job: run(work, job[0], job[1], every[job[0]], a), todo))
    rows = summarize(runs)
    table = Table(
        title=f"held-out {task} after {a.flops:.2g} FLOPs of RL (T=1, {a.eval_problems} problems; "
        f"mean over seeds {a.seeds}, min-max)"
    )
    for col in ("arm", "trained params", "steps", "before", "after", "min-max", "retention after"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["arm"],
            f"{r['trained_params']:,}",
            f"{r['steps']:.0f}",
            f"{r['accuracy_before']:.3f}",
            f"{r['accuracy_after']:.3f}",
            f"{r['accuracy_min']:.3f}–{r['accuracy_max']:.3f}",
            "-" if r["retention_after"] is None else f"{r['retention_after']:.3f}",
        )
    console.print(table)
    command = " ".join(["python benchmarks/compute_matched.py", *(argv if argv is not None else sys.argv[1:])])
    report = {
        "command": command.replace(str(a.family), "<build-family output>"),
        "task": task,
        "flops_budget": a.flops,
        "full_lr": a.full_lr,
        "family": {
            m: json.loads((a.family / m / "pretrain_report.json").read_text())
            for m in sorted({arm.split(":")[0] for arm in arms})
            if (a.family / m / "pretrain_report.json").is_file()
        },
        "seeds": a.seeds,
        "arms": rows,
        "runs": runs,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2))
    plot(runs, task_label(task, command), a.out.with_suffix(".png"))
    console.print(f"wrote {a.out} and {a.out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
