"""README figures against the committed results files their scripts write: the default job's
seeds (`benchmarks/default_job.py`) and the agent envs (`benchmarks/agent_envs.py`). A rerun that
changes a number fails here until the README says the new one."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def results(name: str) -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / name).read_text())


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def test_the_default_job_table_is_the_results_file():
    runs = {(r["mode"], r["seed"]): r for r in results("default_job.json")["runs"]}
    seeds = sorted({s for _, s in runs})
    assert seeds == [0, 1, 2] and {m for m, _ in runs} == {"off", "all"}
    for s in seeds:
        off, on = runs["off", s], runs["all", s]
        assert off["gain_points"] == 100 * (off["addition_after"] - off["addition_before"])
        row = (f"| {s} | {pct(off['addition_before'])} → {pct(off['addition_after'])} (**{off['gain_points']:+.1f}**) | "
               f"{pct(off['retention_before'])} → {pct(off['retention_after'])} (−{off['retention_lost_points']:.1f}) | "
               f"{pct(on['addition_after'])} (**{on['gain_points']:+.1f}**) / {pct(on['retention_after'])} "
               f"(−{on['retention_lost_points']:.1f}) |")
        assert row in README, row


def test_the_agent_env_rows_are_the_results_file():
    r = results("agent_envs.json")["results"]
    calc, guess = r["calculator"], r["guessing"]
    assert (f"| {calc['steps']} | {calc['success_before']:.3f} → {calc['success_after']:.3f} | "
            f"**{calc['gain_points']:+.1f} points**") in README
    assert (f"| {guess['steps']} | {guess['success_before']:.3f} → {guess['success_after']:.3f} | "
            f"**{guess['gain_points']:+.1f} points**") in README
