"""The default job's step at several commits, side by side in one run: where a regression came from.

    python benchmarks/step_by_commit.py [--commits 3167f1e 8015203 8bcafa9 HEAD] [--rounds 3] [--steps 15]

Each commit's `src/` is exported (`git archive`) and run with this environment as `trillora train`
with the GRPO benchmark's settings (`grpo_vs_trl.py`: no evaluation inside the timed steps); the
commits alternate for `--rounds` runs, so a machine that drifts weighs on all of them. Reported:
the median step, rollout and update seconds of each, and each as a ratio of the first commit's.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PHASES = ("step_seconds", "rollout_seconds", "update_seconds")


def export(commit: str, into: Path) -> Path:
    """The commit's `src/` under `into`; the working tree's own for "WORKTREE"."""
    if commit == "WORKTREE":
        return ROOT / "src"
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit, "src"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    folder = into / commit
    folder.mkdir(parents=True)
    (folder / "src.tar").write_bytes(archive)
    with tarfile.open(folder / "src.tar") as tar:
        tar.extractall(folder, filter="data")
    return folder / "src"


def one_run(src: Path, steps: int, warmup: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="step-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # scratch: gone when the script ends
    args = [
        f"steps={steps}",
        f"out_dir={work}",
        "name=bench",
        f"eval_every={steps + 1}",
        'task.retention=""',
        "task.eval_problems=16",
    ]
    subprocess.run(
        [sys.executable, "-m", "trillora", "train", *args],
        check=True,
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(src)},
    )
    rows = [json.loads(x) for x in (work / "bench" / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows[1:] if r["step"] > warmup and "eval_seconds" not in r]
    return {k: statistics.median(r[k] for r in timed) for k in PHASES}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--commits",
        nargs="+",
        default=["3167f1e", "8015203", "8bcafa9", "WORKTREE"],
        help="commits to compare, the first the reference; WORKTREE: the code as it is on disk",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / "step_by_commit.json")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sources = {c: export(c, Path(tmp)) for c in a.commits}
        runs: dict[str, list[dict]] = {c: [] for c in a.commits}
        for round_ in range(a.rounds):
            for c in a.commits:
                runs[c].append(one_run(sources[c], a.steps, a.warmup))
                print(f"round {round_ + 1}/{a.rounds} {c}: {runs[c][-1]}", file=sys.stderr, flush=True)
    medians = {c: {k: statistics.median(r[k] for r in rs) for k in PHASES} for c, rs in runs.items()}
    ref = medians[a.commits[0]]
    table = Table(
        title=f"the default job's step by commit ({a.rounds} alternating runs × {a.steps - a.warmup} timed steps)"
    )
    for col in ("commit", "step s", "rollout s", "update s", "step / first", "rollout / first"):
        table.add_column(col, justify="right")
    for c, m in medians.items():
        table.add_row(
            c,
            f"{m['step_seconds']:.4f}",
            f"{m['rollout_seconds']:.4f}",
            f"{m['update_seconds']:.4f}",
            f"{m['step_seconds'] / ref['step_seconds']:.2f}×",
            f"{m['rollout_seconds'] / ref['rollout_seconds']:.2f}×",
        )
    Console(width=140).print(table)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    a.out.write_text(
        json.dumps(
            {
                "commits": a.commits,
                "worktree_at": head,
                "rounds": a.rounds,
                "steps": a.steps,
                "warmup": a.warmup,
                "medians": medians,
                "runs": runs,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
