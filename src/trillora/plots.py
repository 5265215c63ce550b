"""PNG plots of a run's metrics.jsonl: what people would rather see than read."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import MissingPath, TrilloraError

PANELS = (
    ("reward", ("reward_mean",), "train reward (mean over the batch)"),
    ("accuracy", ("eval_accuracy", "retention_accuracy"), "held-out accuracy (sampled at the rollout temperature)"),
    ("mismatch_kl", ("mismatch_kl_k1", "mismatch_kl_k3"), "rollout vs trainer KL"),
    (
        "is_weights",
        ("is_ratio_min", "is_ratio_mean", "is_ratio_max"),
        "importance ratio trainer / rollout, before its cap",
    ),
)
LABELS = {
    "reward_mean": "mean reward",
    "eval_accuracy": "the task's held-out problems",
    "retention_accuracy": "retention task (right axis)",
    "mismatch_kl_k1": "k1 = mean(log p_rollout - log p_trainer): unbiased, can dip below 0",
    "mismatch_kl_k3": "k3: never below 0",
    "is_ratio_min": "min",
    "is_ratio_mean": "mean",
    "is_ratio_max": "max",
}
"""Legend text of each metric key (the keys themselves are in metrics.jsonl)."""
SECOND_AXIS = ("retention_accuracy",)
"""Drawn on their own right-hand scale from 0 to 1: a retention line near 1.0 on the task's scale
would flatten the task's curve."""


def read_metrics(path: Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise MissingPath(f"{path} does not exist: is {path.parent} a run folder (runs/<name>)?")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise TrilloraError(f"{path}:{i}: not JSON ({e.msg})") from None
    return rows


def plot_run(run_dir: str | Path) -> list[Path]:
    """One PNG per panel (reward, accuracy, mismatch KL, IS weights) plus an overview, and for env runs
    the episodes (turns, and what the envs count per episode: tool calls, parse errors); the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    written = []
    fig_all, axes = plt.subplots(2, 2, figsize=(11, 7))
    resumed = [r["resumed_from"] for r in rows if "resumed_from" in r]
    for (name, keys, title), ax_all in zip(PANELS, axes.flat, strict=True):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for target in (ax, ax_all):
            _panel(target, rows, keys, title, resumed)
        written.append(_save(plt, fig, run_dir / f"{name}.png"))
    if any("turns_mean" in r for r in rows):
        written.append(_plot_episodes(plt, rows, run_dir / "episodes.png"))
    return written + [_save(plt, fig_all, run_dir / "overview.png")]


def _panel(ax, rows: list[dict], keys: tuple[str, ...], title: str, resumed: list[int]) -> None:
    """One panel: each key's line under its label, a second scale for `SECOND_AXIS` keys, a zero
    line where a curve goes below 0, and a dashed mark at each step a run was resumed from."""
    lines = []
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if not pts:
            continue
        xs, ys = zip(*pts, strict=True)
        target = ax
        if key in SECOND_AXIS:  # its own scale, whole (0 to 1), so a change of 0.002 does not look like a fall
            target = ax.twinx()
            target.set_ylim(0, 1.05)
            target.set_ylabel("retention (right axis, 0 to 1)", color="tab:gray")
            target.tick_params(axis="y", colors="tab:gray")
            ax.set_ylabel("the task (left axis)")
        style = {"linestyle": "--", "color": "tab:gray"} if key in SECOND_AXIS else {}
        lines += target.plot(xs, ys, marker="o" if len(pts) < 30 else None, label=LABELS.get(key, key), **style)
        if min(ys) < 0 <= max(ys):
            target.axhline(0, color="black", linewidth=0.6)
    for step in resumed:
        lines.append(ax.axvline(step, color="tab:red", linestyle=":", linewidth=1, label=f"resumed at step {step}"))
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if len(lines) > 1:  # "best" sees the left axis only: below a right-axis line near 1.0 instead
        ax.legend(handles=lines, fontsize=7, loc="lower right" if set(keys) & set(SECOND_AXIS) else "best")


def _plot_episodes(plt, rows: list[dict], path: Path) -> Path:
    """Turns per episode and every per-episode env counter (`env/...`), one line each."""
    keys = ["turns_mean"] + sorted({k for r in rows for k in r if k.startswith("env/")})
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, label=key)
    ax.set_title("per episode: turns and env counters")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(plt, fig, path)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
