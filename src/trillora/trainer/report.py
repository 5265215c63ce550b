"""Rank 0's account of a run as it goes: each step's row in `metrics.jsonl` and the trackers, the
progress bar, a metrics line every `logging.every` steps (as TRL and verl print one), a warning when
the run stops getting a learning signal, and the PNG plots redrawn every `logging.plot_seconds`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console

from .. import rl
from ..config import TrainConfig

CONSOLE_KEYS = (
    ("reward_mean", "reward", ".3f"),
    ("groups_all_equal", "one-reward groups", ".2f"),
    ("loss", "loss", ".4f"),
    ("grad_norm", "grad norm", ".3f"),
    ("clip_frac", "clipped", ".3f"),
    ("mismatch_kl_k3", "rollout-trainer kl", ".2e"),
    ("completion_len_mean", "length", ".1f"),
    ("step_seconds", "step s", ".2f"),
)
SIGNAL_WINDOW = 5
"""Steps over which `rl.little_signal` averages the share of one-reward groups."""


def console_line(row: dict, accuracy: float) -> str:
    """A step's metrics on one line (`logging.every`, and every step with an evaluation)."""
    parts = [f"{label} {row[k]:{fmt}}" for k, label, fmt in CONSOLE_KEYS if isinstance(row.get(k), (int, float))]
    if "eval_accuracy" in row:
        parts.append(f"held-out acc {accuracy:.3f}")
        if "retention_accuracy" in row:
            parts.append(f"retention {row['retention_accuracy']:.3f}")
    return f"step {row['step']}: " + "  ".join(parts)


class RunReport:
    def __init__(self, cfg: TrainConfig, console: Console, trackers, metrics_file: Path):
        self.cfg, self.console, self.trackers, self.metrics_file = cfg, console, trackers, metrics_file
        self.all_equal: list[float] = []  # each step's groups_all_equal
        self.warned_at, self.little_signal_warnings = -(10**9), 0
        self.plotted = time.monotonic()

    def step(self, row: dict, accuracy: float, bar, job) -> None:
        """The step's row (with a warning when due) appended and tracked, the bar moved, the line printed."""
        self._warn_on_little_signal(row)
        with open(self.metrics_file, "a") as log:
            log.write(json.dumps(row) + "\n")
        self.trackers.log(row, row["step"])
        bar.update(
            job,
            advance=1,
            info=f"reward {row['reward_mean']:.2f}  held-out acc {accuracy:.3f}  {row['step_seconds']:.2f}s/step",
        )
        every = self.cfg.logging.every
        if every and (row["step"] % every == 0 or row["step"] == self.cfg.steps or "eval_accuracy" in row):
            self.console.print(console_line(row, accuracy))
        self.replot(due=self.cfg.logging.plot_seconds)

    def replot(self, due: float) -> None:
        """Redraw the PNG plots when `due` seconds passed since the last drawing."""
        if time.monotonic() - self.plotted < due:
            return
        from ..plots import plot_run  # matplotlib: imported when first drawn, not when trillora starts

        plot_run(self.cfg.run_dir)
        self.plotted = time.monotonic()

    def _warn_on_little_signal(self, row: dict) -> None:
        """Most groups giving every sample one reward, step after step: no advantage, no gradient.
        Said in the console and in the step's row (`warning`), again every window while it lasts."""
        self.all_equal.append(row["groups_all_equal"])
        share = rl.little_signal(self.all_equal, SIGNAL_WINDOW)
        if share is None or row["step"] - self.warned_at < SIGNAL_WINDOW:
            return
        self.warned_at = row["step"]
        self.little_signal_warnings += 1
        row["warning"] = (
            f"little learning signal: over the last {SIGNAL_WINDOW} steps {share:.0%} of groups gave all "
            f"{self.cfg.rollout.group_size} samples one reward (mean reward {row['reward_mean']:.2f}), so their "
            "advantages are 0. The task may be too easy or too hard for the model; try a larger "
            "rollout.group_size, another rollout.temperature, algorithm.dynamic_sampling=true, or check the reward"
        )
        self.console.print(f"[yellow]warning at step {row['step']}[/]: {row['warning']}")
