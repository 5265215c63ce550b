"""Success on a long-horizon env against the memory budget, for each memory policy, and Memory
Diffusion after RL.

    python benchmarks/context_budget.py --model runs/tiny-moe-memory [--seeds 0 1 2] [--episodes 64] [--rl-steps 40]
    python benchmarks/context_budget.py --config examples/registers.toml --model runs/tiny-moe-registers [key=value ...]

`--config` (default `examples/ledger.toml`) names the env, its turns and the Memory Diffusion
settings; `--model`: a checkpoint that can do that env with the whole context (`python -m
trillora.tiny build-memory OUT [--env registers]`; the shipped models cannot, so every memory would
score noise). Each held-out episode (the ledger: 6 facts, 3 distractors, the question about one of
the first two; the registers: 8 lines of 3 writes) is played at T = 1 with the whole context,
then at 1/2, 1/4 and 1/8 of the mean whole-episode length under truncation, retrieval (BM25
`recall:`) and a summary after every turn, each on spans of `--span-tokens` (ending between
words), and Memory Diffusion as the config's `[memory]` sets it (`examples/ledger.toml`: surprise
importance, proportional, whole turns, so that a refill rewrites a turn). The env's module must
define `refill_kept(prompt, refill, key, value)` (the ledger's and the registers' do). A turn may
write the config's `rollout.max_new_tokens` (10: "recall:c=" and its stop), so every context holds
at most the budget less that.
Reported per policy and budget: success (mean and per seed), refill quality (of the refills that
rewrote a chunk holding the asked fact, the share that kept it) and the tokens processed per episode
(every call's context read plus the tokens written: turns, refills, summaries; the importance
scorer's forwards are not counted). With `--rl-steps N`, Memory Diffusion is also trained by RL
at each budget (the config: refills and answers trained with the episode's reward, one
run per `--rl-seeds` seed) and played again with each adapter ("diffusion+rl": one row over the RL
seeds, with each seed's success for the band). Writes
benchmarks/results/context_budget.json (context_budget_<name>.json for another config) and a PNG
(success against the budget, a min–max band over the seeds); `--replot FILE` redraws a file's PNG.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import importlib
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trillora.checkpoint import load_model, load_tokenizer
from trillora.config import MemorySection, TrainConfig, load_config
from trillora.envs.env_dataset import load_env_dataset
from trillora.lora import load_adapter
from trillora.rollout import LocalEngine, SamplingParams
from trillora.trainer.episodes import EpisodeLimits, run_groups
from trillora.trainer.sampler import memory_factory

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
POLICIES = ("truncate", "retrieval", "summary", "diffusion", "diffusion+rl")


def play(engine, tokenizer, episodes: int, seed: int, memory: MemorySection | None, cfg: TrainConfig) -> dict:
    """`episodes` held-out episodes of the config's env, a turn writing up to its max_new_tokens
    ("ok", a digit, or "recall:c=": 9 tokens) within its max_turns (the env's turns and one call)."""
    ds = load_env_dataset(cfg.task.options, tokenizer=tokenizer, batch_size=1, group_size=1, eval_size=episodes, seed=0)
    refill_kept = importlib.import_module(cfg.task.options["env"].split(":")[0]).refill_kept
    params = SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=1.0,
        seed=seed,
        stop_token_ids=(tokenizer.eos_token_id,),
    )
    limits = EpisodeLimits(
        max_turns=cfg.task.max_turns,
        max_model_len=engine.model.args.max_position_embeddings,
        memory=memory_factory(memory, engine, tokenizer) if memory else None,
    )
    ledgers = ds.eval_batch()
    groups = run_groups(engine, ledgers, params, limits)
    trajectories = [t for g in groups for t in g.trajectories]
    refills = [
        (tokenizer.decode(x.observation), tokenizer.decode(x.action), ledger)
        for ledger, g in zip(ledgers, groups, strict=True)
        for t in g.trajectories
        for x in t.transitions
        if "memory_refill_tokens" in x.metrics
    ]
    kept = [refill_kept(prompt, refill, ledger.key, ledger.value) for prompt, refill, ledger in refills]
    with_fact = [k for k in kept if k is not None]
    # the allocation gave the refill room for the fact (its budget, "]] N:", at least the fact's tokens)
    room = [
        int(re.search(r"(\d+):\n$", prompt).group(1))  # the prompt ends "N:\n"
        >= len(tokenizer(f"{ledger.key}={ledger.value}", add_special_tokens=False)["input_ids"])
        for prompt, _, ledger in refills
    ]
    with_room = [k for k, r in zip(kept, room, strict=True) if k is not None and r]
    rewards = [r for g in groups for r in g.total_rewards()]
    processed = [sum(len(x.observation) + len(x.action) for x in t.transitions) for t in trajectories]
    longest = [max(len(x.observation) + len(x.action) for x in t.transitions) for t in trajectories]
    return {
        "success": statistics.fmean(rewards),
        "tokens_processed": statistics.fmean(processed),
        "longest_context": statistics.fmean(longest),
        "refills": len(kept),
        "refills_with_fact": len(with_fact),
        "refills_keeping_fact": sum(with_fact),
        "refills_with_room": len(with_room),
        "refills_keeping_fact_with_room": sum(with_room),
    }


def plot(rows: list[dict], full: float, path: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for policy in POLICIES:
        mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["fraction"])
        if not mine:
            continue
        x = [r["fraction"] for r in mine]
        (line,) = ax.plot(x, [r["success"] for r in mine], marker="o", label=policy)
        seeds = [r["success_per_seed"] + r.get("success_per_rl_seed", []) for r in mine]  # the min–max band
        ax.fill_between(x, [min(s) for s in seeds], [max(s) for s in seeds], color=line.get_color(), alpha=0.2)
    ax.axhline(full, color="gray", ls="--", label="whole context")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("memory budget / whole episode")
    ax.set_ylabel(f"{name} success (T=1)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train_diffusion(
    config: Path, overrides: list[str], model: str, budget: int, seed: int, steps: int, work: Path
) -> tuple[Path, dict]:
    """RL with Memory Diffusion at `budget` (the example config); the adapter and the run's summary,
    with what its training steps saw (`training`: the means over its steps of the metrics that say
    whether refills could learn)."""
    name = f"diffusion-b{budget}-s{seed}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trillora",
            "train",
            str(config),
            *overrides,
            f"model.path={model}",
            f"memory.budget={budget}",
            f"seed={seed}",
            f"steps={steps}",
            f"eval_every={steps}",
            f"out_dir={work}",
            f"name={name}",
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"RL at budget {budget} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((work / name / "summary.json").read_text())
    steps = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "reward_mean" in r and r["step"] > 0]
    summary["training"] = {
        key: statistics.fmean(r.get(metric) or 0.0 for r in steps)
        for key, metric in (
            ("groups_all_equal", "groups_all_equal"),  # groups whose samples all got one reward: no advantage
            ("refill_tokens", "env/memory_refill_tokens"),  # per episode
            ("policy_tokens", "completion_len_mean"),  # per episode, every turn and refill
            ("reward", "reward_mean"),
        )
    }
    return work / name / "adapter" / "fused", summary


def refills_of(runs: list[dict]) -> dict:
    """Refill quality over runs: how many refills, how many rewrote a chunk holding the asked fact
    whole, the share of those that kept it (None when none did), and the same share among those
    whose budget could hold the fact (what the refill did, apart from what the allocation allowed)."""
    n, held, kept, roomy, kept_roomy = (
        sum(r[k] for r in runs)
        for k in (
            "refills",
            "refills_with_fact",
            "refills_keeping_fact",
            "refills_with_room",
            "refills_keeping_fact_with_room",
        )
    )
    return {
        "refills": n,
        "refills_with_fact": held,
        "fact_kept": kept / held if held else None,
        "refills_with_room": roomy,
        "fact_kept_with_room": kept_roomy / roomy if roomy else None,
    }


def rl_row(fraction: float, budget: int, rl_seeds: list[int], steps: int, trained: list[tuple[dict, list]]) -> dict:
    """One row for the RL seeds together: success over every (RL seed, eval seed) pair, per eval seed
    (averaged over the RL seeds) and per RL seed (the band)."""
    per_rl = [[r["success"] for r in runs] for _, runs in trained]  # [RL seed][eval seed]
    return {
        "policy": "diffusion+rl",
        "fraction": fraction,
        "budget": budget,
        "rl_seeds": rl_seeds,
        "rl_steps": steps,
        "rl_seconds": statistics.fmean(summary["seconds"] for summary, _ in trained),
        "rl_flops": statistics.fmean(summary["flops_total"] for summary, _ in trained),
        "rl_training": {k: statistics.fmean(s["training"][k] for s, _ in trained) for k in trained[0][0]["training"]},
        "success": statistics.fmean(x for seed in per_rl for x in seed),
        "success_per_seed": [statistics.fmean(col) for col in zip(*per_rl, strict=True)],
        "success_per_rl_seed": [statistics.fmean(seed) for seed in per_rl],
        "tokens_processed": statistics.fmean(r["tokens_processed"] for _, runs in trained for r in runs),
        **refills_of([r for _, runs in trained for r in runs]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="required unless --replot")
    p.add_argument("--replot", type=Path, help="only redraw the PNG of this results file")
    p.add_argument("overrides", nargs="*", help="key=value settings over the config's (the plays and the RL runs)")
    p.add_argument("--config", type=Path, default=ROOT / "examples" / "ledger.toml", help="the env and its memory")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25, 0.125])
    p.add_argument(
        "--span-tokens",
        type=int,
        default=6,
        help="chunks of truncation, retrieval and summary: spans of this many tokens, ending between words "
        "(0: whole turns, which at 1/4 of an episode leave no room beyond the task and the latest turn)",
    )
    p.add_argument("--rl-steps", type=int, default=0, help="also train Memory Diffusion by RL at each budget")
    p.add_argument("--rl-seeds", type=int, nargs="+", default=[0])
    p.add_argument("--out", type=Path, help="default: results/context_budget.json, or _<config name>.json")
    a = p.parse_args()
    if a.replot:
        r = json.loads(a.replot.read_text())
        name = r.get("env", {}).get("env", "trillora.envs.ledger:").split(":")[0].rsplit(".", 1)[-1]
        plot(r["rows"], r["whole_context"]["success"], a.replot.with_suffix(".png"), name)
        return
    if not a.model:
        p.error("--model is required")
    if a.overrides and a.out is None:  # the default name would be the plain config's results
        p.error("with key=value overrides, name the results file with --out")
    cfg = load_config(a.config, a.overrides)
    diffusion = cfg.memory  # played before and after its RL
    a.out = a.out or RESULTS / ("context_budget.json" if cfg.name == "ledger" else f"context_budget_{cfg.name}.json")
    work = Path(tempfile.mkdtemp(prefix="memory-budget-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # scratch: gone when the script ends
    tokenizer = load_tokenizer(a.model)
    engine = LocalEngine(load_model(a.model), precision="fp32")
    console = Console(width=120)
    with console.status("the whole context"):
        whole = [play(engine, tokenizer, a.episodes, s, None, cfg) for s in a.seeds]
    length = statistics.fmean(w["longest_context"] for w in whole)
    rows = []
    with console.status("memories") as status:
        for fraction in a.fractions:
            budget = max(int(length * fraction), cfg.rollout.max_new_tokens + 1)
            for policy in POLICIES[:-1]:
                status.update(f"{policy} at {fraction:g} ({budget} tokens)")
                memory = (
                    dataclasses.replace(diffusion, budget=budget)
                    if policy == "diffusion"
                    else MemorySection(policy=policy, budget=budget, span_tokens=a.span_tokens)
                )
                runs = [play(engine, tokenizer, a.episodes, s, memory, cfg) for s in a.seeds]
                rows.append(
                    {
                        "policy": policy,
                        "fraction": fraction,
                        "budget": budget,
                        "success": statistics.fmean(r["success"] for r in runs),
                        "success_per_seed": [r["success"] for r in runs],
                        "tokens_processed": statistics.fmean(r["tokens_processed"] for r in runs),
                        **refills_of(runs),
                    }
                )
            trained = []  # per RL seed: (summary, runs over the eval seeds)
            for rl_seed in a.rl_seeds if a.rl_steps else []:
                status.update(f"RL with Memory Diffusion at {fraction:g} ({budget} tokens), seed {rl_seed}")
                adapter, summary = train_diffusion(a.config, a.overrides, a.model, budget, rl_seed, a.rl_steps, work)
                policy = LocalEngine(load_adapter(load_model(a.model), adapter), precision="fp32")
                memory = dataclasses.replace(diffusion, budget=budget)
                trained.append((summary, [play(policy, tokenizer, a.episodes, s, memory, cfg) for s in a.seeds]))
            if trained:
                rows.append(rl_row(fraction, budget, a.rl_seeds, a.rl_steps, trained))
    full = statistics.fmean(w["success"] for w in whole)
    table = Table(
        title=f"{cfg.name} success vs memory budget (whole episode ≈ {length:.0f} tokens; whole context: {full:.3f})"
    )
    for col in ("policy", "budget", "success (per seed)", "tokens processed / episode"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["policy"],
            f"{r['fraction']:g} ({r['budget']})",
            f"{r['success']:.3f} ({', '.join(f'{x:.2f}' for x in r['success_per_seed'])})",
            f"{r['tokens_processed']:.0f}",
        )
    console.print(table)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python benchmarks/context_budget.py", *sys.argv[1:]]).replace(a.model, "<build-memory output>")
    a.out.write_text(
        json.dumps(
            {
                "command": command,
                "episode_tokens": length,
                "span_tokens": a.span_tokens,
                "env": cfg.task.options,
                "overrides": a.overrides,
                "diffusion": dataclasses.asdict(diffusion),
                "whole_context": {
                    "success": full,
                    "success_per_seed": [w["success"] for w in whole],
                    "tokens_processed": statistics.fmean(w["tokens_processed"] for w in whole),
                },
                "rows": rows,
            },
            indent=2,
        )
    )
    plot(rows, full, a.out.with_suffix(".png"), cfg.name)


if __name__ == "__main__":
    main()
