"""`trillora plan`: the chosen layout, its memory and traffic, the runners-up, LoRA vs full-parameter
and the rollout engine's layout, as tables or as JSON; with --tinker, the Tinker service's layouts
(experts over ep) and how many training clients each holds."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from ..models.params import resolve_args
from ..parallel.dims import ParallelDims
from ..plan.clusters import CLUSTERS
from ..plan.cost import Estimate, Footprint, Training, Workload, short
from ..plan.planner import Plan, lora_vs_full, plan, plan_service, rollout_layout, smallest_cluster
from .info import human

GIB = 2**30


def estimate_dict(e: Estimate) -> dict:
    return {
        "layout": asdict(e.layout),
        "memory_gib": {k: v / GIB for k, v in e.memory.items()},
        "memory_total_gib": e.memory_total / GIB,
        "comm_gib_per_step": {k: v / GIB for k, v in e.comm.items()},
        "compute_s": e.compute_s,
        "comm_s": e.comm_s,
        "bubble": e.bubble,
        "step_s": e.step_s,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="shipped name (kimi-k2, ...), config.json or checkpoint folder")
    p.add_argument("--gpus", type=int, default=0, help="world size to plan for (0: the smallest cluster that fits)")
    p.add_argument("--gpu", default="h800", choices=sorted(CLUSTERS), help="cluster preset")
    p.add_argument("--seq-len", type=int, default=32768, help="tokens per trained sequence (prompt + completion)")
    p.add_argument(
        "--rollouts", type=int, default=512, help="sequences trained per optimizer step (prompts × group size)"
    )
    p.add_argument("--micro-batch", type=int, default=1, help="rows per microbatch")
    p.add_argument("--passes", type=int, default=1, help="epochs × minibatches (> 1 adds an old-logprob pass)")
    p.add_argument("--kl", action="store_true", help="a reference-logprob pass (full: a frozen copy of the base)")
    p.add_argument("--lora-rank", type=int, default=128)
    p.add_argument("--expert-rank", type=int, default=0, help="rank of routed-expert adapters (0: --lora-rank)")
    p.add_argument("--targets", default="attention,mlp,shared_experts,experts", help="LoRA targets, comma-separated")
    p.add_argument("--full", action="store_true", help="plan full-parameter training instead of LoRA")
    p.add_argument("--fp8-base", action="store_true", help="keep the frozen base in fp8 (LoRA only)")
    p.add_argument("--top", type=int, default=5, help="layouts to list")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--tinker",
        action="store_true",
        help="plan `trillora serve --tinker` instead: --rollouts datums "
        "per forward_backward call, --lora-rank per client",
    )
    p.add_argument("--clients", type=int, default=16, help="--tinker: training clients held at once")


def run(a: argparse.Namespace) -> dict:
    if a.tinker:
        return run_service(a)
    args = resolve_args(a.model)
    cluster = CLUSTERS[a.gpu]
    training = Training(
        lora_rank=a.lora_rank,
        expert_rank=a.expert_rank,
        full=a.full,
        targets=tuple(t.strip() for t in a.targets.split(",") if t.strip()),
        base_bytes=1 if a.fp8_base and not a.full else 2 if cluster.act_bytes == 2 else 4,
    )
    work = Workload(
        seq_len=a.seq_len, rollouts_per_step=a.rollouts, micro_batch_rows=a.micro_batch, passes=a.passes, kl=a.kl
    )
    fp = Footprint(args, training)
    result: Plan | None = plan(fp, a.gpus, cluster, work, a.top) if a.gpus else smallest_cluster(fp, cluster, work)
    out = {
        "model": a.model,
        "cluster": asdict(cluster),
        "workload": asdict(work),
        "training": asdict(training),
        "params_total": fp.total,
        "params_trainable": fp.trainable,
    }
    if result is None:
        out["fits"] = False
        return out
    out.update(
        gpus=result.world,
        fits=result.fits,
        best=[estimate_dict(e) for e in result.best],
        least_memory=estimate_dict(result.smallest),
    )
    out["lora_vs_full"] = lora_vs_full(args, replace(training, full=False), cluster, work)
    rollout = rollout_layout(args, result.world, cluster, weight_bytes=1 if a.fp8_base else 2)
    out["rollout"] = asdict(rollout) if rollout else None
    if result.fits:
        out["launch"] = launch_command(out["best"][0]["layout"], result.world, cluster.gpus_per_node, training)
    return out


def launch_command(layout: dict, world: int, per_node: int, training: Training) -> str:
    """The torchrun command that trains with `layout` (its fields that differ from `ParallelDims`'
    defaults, as `parallel.*` overrides) on `world` ranks, `per_node` to a node; CONFIG.toml is the
    user's run config (model.path, task, rollout)."""
    defaults = asdict(ParallelDims())
    nodes = -(-world // per_node)
    launcher = f"torchrun --nnodes {nodes} --nproc-per-node {min(world, per_node)}"
    if nodes > 1:
        launcher += " --rdzv-backend c10d --rdzv-endpoint HOST:29500"  # HOST: the first node's address
    keys = []
    for k, v in layout.items():
        if v != defaults[k] and k in defaults:
            keys.append(f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}")
    if not training.full:
        keys.append(f"lora.rank={training.lora_rank}")
    return f"{launcher} -m trillora train CONFIG.toml {' '.join(keys)}"


SHOWN = 10  # rows of the service table beyond those that fit


CHOSEN_KEYS = ("pp", "pp_microbatches", "tp", "ep", "cp", "sp", "fsdp", "vocab_parallel", "activation_checkpoint_every")
LAYOUT_KEYS = (*CHOSEN_KEYS, "dp")


def run_service(a: argparse.Namespace) -> dict:
    """The service's layouts on --gpus ranks (0: the fewest GPUs, doubling, on which one fits)."""
    if a.clients < 1 or a.rollouts < 1:
        raise ValueError(f"--clients {a.clients} and --rollouts {a.rollouts}: both must be >= 1")
    args, cluster = resolve_args(a.model), CLUSTERS[a.gpu]
    base_bytes = 4 if cluster.act_bytes == 4 else 2
    divided = max(1, a.lora_rank // max(1, args.top_k))  # the service's expert ranks: `serve --expert-rank-rule`
    if a.expert_rank not in (0, a.lora_rank, divided):
        raise ValueError(
            f"--expert-rank {a.expert_rank} with --tinker: a service's expert adapters take the client's rank "
            f"({a.lora_rank}) or rank // top_k ({divided}, serve --expert-rank-rule divide_by_top_k)"
        )

    def layouts(world: int):
        return plan_service(
            args, world, cluster, a.clients, a.lora_rank, a.seq_len, a.rollouts, base_bytes, a.expert_rank
        )

    world = a.gpus or next((w for w in (2**i for i in range(11)) if any(x.fits for x in layouts(w))), 1024)
    found = layouts(world)
    ok = [x for x in found if x.fits]
    out = {
        "model": a.model,
        "cluster": asdict(cluster),
        "tinker": True,
        "gpus": world,
        "clients": a.clients,
        "lora_rank": a.lora_rank,
        "seq_len": a.seq_len,
        "datums_per_call": a.rollouts,
        "fits": bool(ok),
        "layouts": [
            {
                **{k: getattr(x.layout, k) for k in LAYOUT_KEYS},
                "call_s": x.estimate.step_s,
                "comm_s": x.estimate.comm_s,
                "memory_gib": {k: v / GIB for k, v in x.estimate.memory.items()},
                "memory_total_gib": x.estimate.memory_total / GIB,
                "per_client_gib": x.per_client_bytes / GIB,
                "max_clients": x.max_clients,
                "fits": x.fits,
            }
            for x in found
        ],
    }
    if ok:  # the fastest that fits
        best = ok[0].layout
        out["chosen"] = {k: out["layouts"][found.index(ok[0])][k] for k in CHOSEN_KEYS}
        weights = a.model if Path(a.model).is_dir() else f"<{a.model} checkpoint>"  # a shipped name is a config only
        flags = (  # serve's defaults are ParallelDims': the base sharded over dp unless --no-fsdp
            (" --no-fsdp" if not best.fsdp and best.dp > 1 else "")
            + (f" --pp {best.pp}" if best.pp > 1 else "")
            + (f" --pp-microbatches {best.pp_microbatches}" if best.pp > 1 else "")
            + (f" --cp {best.cp}" if best.cp > 1 else "")
            + (f" --tp {best.tp}" if best.tp > 1 else "")
            + (" --sp" if best.sp else "")
            + (" --vocab-parallel" if best.vocab_parallel else "")
            + (f" --ep {best.ep}" if best.ep > 1 else "")
            + (" --activation-checkpoint-every 1" if best.activation_checkpoint_every else "")
            + (" --expert-rank-rule divide_by_top_k" if a.expert_rank not in (0, a.lora_rank) else "")
        )
        out["command"] = (
            f"torchrun --nproc-per-node {world} -m trillora serve {weights} --tinker --device cuda "
            f"--precision bf16{flags} --max-clients {a.clients}"
        )
    return out


def render_service(out: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    c = out["cluster"]
    console.print(
        f"[bold]{out['model']}[/] served to {out['clients']} Tinker clients (LoRA rank {out['lora_rank']} on "
        f"every role), {out['datums_per_call']} × {out['seq_len']} tokens per call, on {out['gpus']} "
        f"{c['name']} ({c['memory_gib']:.0f} GiB, {c['memory_gib'] * (1 - c['reserve']):.0f} usable)"
    )
    shown = [x for i, x in enumerate(out["layouts"]) if i < SHOWN or x["fits"]]  # --json lists them all
    t = Table(title=f"memory per GPU (GiB): the {SHOWN} fastest layouts and every one that fits, fastest first")
    columns = (
        "pp",
        "cp",
        "tp",
        "sp",
        "vocab",
        "ep",
        "fsdp",
        "ac",
        "s per call",
        "base",
        "one pass",
        "clients",
        "total",
    )
    for col in (*columns, "clients that fit"):
        t.add_column(col, justify="right")
    for x in shown:
        m = x["memory_gib"]
        t.add_row(
            str(x["pp"]),
            str(x["cp"]),
            str(x["tp"]),
            "yes" if x["sp"] else "",
            "yes" if x["vocab_parallel"] else "",
            str(x["ep"]),
            "yes" if x["fsdp"] else "",
            "yes" if x["activation_checkpoint_every"] else "",
            f"{x['call_s']:.2f}",
            f"{m['base weights']:.1f}",
            f"{m['activations'] + m['transient']:.1f}",
            f"{m['clients: adapter + grads + AdamW + revision']:.1f}",
            f"{x['memory_total_gib']:.1f}",
            f"{x['max_clients']}" if x["fits"] else f"[red]{x['max_clients']}[/]",
        )
    console.print(t)
    if len(shown) < len(out["layouts"]):
        console.print(f"({len(out['layouts']) - len(shown)} slower layouts that do not fit left out; --json lists all)")
    if out["fits"]:
        ac = " with activation checkpointing" if out["chosen"]["activation_checkpoint_every"] else ""
        ch = out["chosen"]
        pp = (f"pp={ch['pp']} ({ch['pp_microbatches']} chunks a call) " if ch["pp"] > 1 else "") + (
            f"cp={ch['cp']} " if ch["cp"] > 1 else ""
        )
        extras = (
            (" with sequence parallelism" if ch["sp"] else "")
            + (" with the base sharded (FSDP)" if ch["fsdp"] else "")
            + (" with the head over the vocabulary" if ch["vocab_parallel"] else "")
        )
        console.print(
            f"chosen: {pp}tp={ch['tp']} ep={ch['ep']}{extras}{ac} (the fastest that fits)\n  {out['command']}"
        )
    else:
        console.print(f"[red]no layout of {out['gpus']} GPUs holds {out['clients']} clients[/]")


def render(out: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    if out.get("tinker"):
        return render_service(out)
    console = Console()
    c, w = out["cluster"], out["workload"]
    kind = "full-parameter" if out["training"]["full"] else f"LoRA rank {out['training']['lora_rank']}"
    console.print(
        f"[bold]{out['model']}[/] {kind}: {human(out['params_total'])} parameters, "
        f"{human(out['params_trainable'])} trained; {w['rollouts_per_step']} × {w['seq_len']} tokens per step "
        f"on {c['name']} ({c['memory_gib']:.0f} GiB, {c['gpus_per_node']} per node)"
    )
    if "gpus" not in out:
        console.print("[red]does not fit on any cluster searched[/]")
        return
    if not out["fits"]:
        least = out["least_memory"]
        console.print(
            f"[red]no layout fits on {out['gpus']} GPUs[/]: the leanest, {_short(least['layout'])}, needs "
            f"{least['memory_total_gib']:.1f} GiB per GPU"
        )
        return
    best = out["best"][0]
    console.print(
        f"chosen layout on {out['gpus']} GPUs: [bold]{_short(best['layout'])}[/], "
        f"~{best['step_s']:.1f} s per step (compute {best['compute_s']:.1f} s, communication "
        f"{best['comm_s']:.1f} s, bubble {100 * best['bubble']:.1f}%)"
    )
    t = Table(title="memory per GPU (GiB)")
    t.add_column("part")
    t.add_column("GiB", justify="right")
    for k, v in best["memory_gib"].items():
        t.add_row(k, f"{v:.1f}")
    t.add_row(
        "[bold]total[/]",
        f"[bold]{best['memory_total_gib']:.1f}[/] of {c['memory_gib'] * (1 - c['reserve']):.0f} usable",
    )
    console.print(t)
    t = Table(title="traffic per GPU per step (GiB)")
    t.add_column("collective")
    t.add_column("GiB", justify="right")
    for k, v in best["comm_gib_per_step"].items():
        t.add_row(k, f"{v:.2f}")
    console.print(t)
    t = Table(title="fastest layouts that fit")
    for col in ("layout", "memory GiB", "step s", "compute s", "comm s", "bubble"):
        t.add_column(col, justify="right")
    for e in out["best"]:
        t.add_row(
            _short(e["layout"]),
            f"{e['memory_total_gib']:.1f}",
            f"{e['step_s']:.1f}",
            f"{e['compute_s']:.1f}",
            f"{e['comm_s']:.1f}",
            f"{100 * e['bubble']:.1f}%",
        )
    console.print(t)
    lf = out["lora_vs_full"]
    if lf.get("ratio") is not None:
        console.print(
            f"LoRA vs full-parameter: at least {lf['lora_min_gpus']} vs {lf['full_min_gpus']} GPUs "
            f"({100 * lf['ratio']:.0f}%)"
        )
    if out.get("launch"):
        console.print(f"launch (on every node): {out['launch']}", soft_wrap=True)
    r = out["rollout"]
    if r:
        console.print(
            f"rollout engine: tp={r['tp']} pp={r['pp']} per replica, {r['replicas']} replica(s); "
            f"{r['weights_gib']:.1f} GiB of weights and {r['kv_cache_gib']:.1f} GiB for the KV cache per GPU"
        )


def _short(layout: dict) -> str:
    return short(ParallelDims(**layout))


def cmd_plan(a: argparse.Namespace) -> int:
    try:
        out = run(a)
    except ValueError as e:  # no layout divides this model / workload / world size
        print(f"trillora plan: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        render(out)
    return 0 if out.get("fits") else 1
