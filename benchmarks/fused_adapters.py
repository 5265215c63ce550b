"""Several clients' adapters in one pass through one resident base vs one pass per adapter.

    python benchmarks/fused_adapters.py [--adapters 4] [--rows 16] [--rank 8] [--device cpu] [--precision fp32]
                                        [--shape qwen3-30b-a3b --layers 4] [--ep 2]

The Tinker service's compute alone (no HTTP): K training clients (rank `--rank`, every role), each
with `--rows` 3-digit-addition rows. "one pass per adapter": K forward_backward calls, as a server
that runs each request alone does; "one pass": the K calls fused (`forward_backward_many`: rows
grouped per adapter, per (expert, adapter) in MoE layers). The same for sampling: K samplers, each
`--samples` completions of one prompt, `--max-tokens` tokens, alone vs one `generate`. Before
timing, the fused results are checked against the separate ones (logprobs, every gradient).
`--shape`: instead of the tiny model's weights, a shipped config's layer shapes (its first
`--layers` layers) with random weights, the tiny tokenizer's ids as input.
`--ep K`: the service on K gloo ranks holding E/K experts each (`policy.world`), each
call's rows split over them; fused, every routed row's adapter travels with it through the
all-to-all. Rank 0 times the calls; the adapters get their non-zero B from one AdamW step each
(a random fill on rank 0 alone would leave the ranks' adapters apart).
Writes benchmarks/results/fused_adapters[_<device>][_<shape>][_ep<K>].json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ROLES = ("attention", "mlp", "shared_experts", "experts", "lm_head")


def addition_rows(service, rows: int, seed: int):
    from trillora.serve.tinker.wire import Datum

    rng, data = random.Random(seed), []
    for _ in range(rows):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        prompt = service.tokenizer.encode(f"{a}+{b}=", add_special_tokens=False)
        ids = prompt + service.tokenizer.encode(str(a + b), add_special_tokens=False)
        weights = np.array([0.0] * (len(prompt) - 1) + [1.0] * (len(ids) - len(prompt)), dtype=np.float32)
        data.append(Datum(ids[:-1], {"target_tokens": np.array(ids[1:]), "weights": weights}))
    return data


def grads(service, model_ids) -> dict[str, torch.Tensor]:
    out = {}
    for m in model_ids:
        for k, p in service.client(m).adapter.params.items():
            if p.grad is not None:
                out[f"{m}/{k}"] = p.grad.float().clone()
                p.grad = None
    return out


def differences(alone, want, other, got) -> tuple[float, float]:
    """Max |logprob| difference and max gradient difference relative to each tensor's largest entry."""
    logprob = max(
        float(np.abs(a - b).max())
        for (x, _), (y, _) in zip(alone, other, strict=True)
        for a, b in zip(x, y, strict=True)
    )
    grad = max(float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp(min=1e-12)) for k in want)
    return logprob, grad


def timed(fn, device: str, reps: int) -> float:
    fn()  # warm-up: first-call allocations and kernels out of the timing
    best = float("inf")
    for _ in range(reps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> dict:
    from trillora.serve.tinker.service import TinkerService

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-moe-chat")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--shape", default=None, help="a shipped config (qwen3-30b-a3b, ...) with random weights")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel gloo ranks (CPU)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.command = "python benchmarks/fused_adapters.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.ep > 1:
        return on_ranks(args)
    if args.device == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    return measure(args, TinkerService(config(args), model=shaped(args)))


def config(args, **extra):
    from trillora.serve.config import ServeConfig

    return ServeConfig(
        model=args.model,
        device=args.device,
        precision=args.precision,
        state_dir=tempfile.mkdtemp(prefix="fused-bench-"),
        **extra,
    )


def on_ranks(args) -> dict:
    """`--ep K`: K spawned gloo ranks; rank 0 measures and writes the report."""
    import torch.multiprocessing as mp

    if args.device != "cpu" or args.shape:
        raise SystemExit("--ep runs on CPU gloo ranks with the tiny model's weights; drop --device / --shape")
    sys.path.insert(0, str(ROOT / "tests"))
    from engine_helpers import free_port

    # forkserver, not spawn: its children end with os._exit, so gloo's threads cannot abort them in
    # the interpreter's teardown (see policy.world.leave_rank)
    mp.start_processes(_rank, args=(args, free_port()), nprocs=args.ep, start_method="forkserver")
    return json.loads(output_path(args).read_text())


def _rank(rank: int, args, port: int) -> None:
    import torch.distributed as dist

    from trillora.serve.tinker.service import TinkerService

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ep)
    try:
        from trillora.parallel import ParallelDims

        service = TinkerService(config(args, parallel=ParallelDims(dp=0, ep=args.ep, fsdp=False)))
        if rank == 0:
            try:
                measure(args, service)
            finally:
                service.stop()
        else:
            service.follow()
    finally:
        dist.destroy_process_group()


def output_path(args) -> Path:
    suffix = "" if args.device == "cpu" else f"_{args.device.split(':')[0]}"
    shape = f"_{args.shape}" if args.shape else ""
    ep = f"_ep{args.ep}" if args.ep > 1 else ""
    return Path(args.out or RESULTS / f"fused_adapters{suffix}{shape}{ep}.json")


def shaped(args):
    """A shipped config's first layers with random weights (`--shape`), or None: the checkpoint's."""
    model = None
    if args.shape:
        from trillora.models import build_model
        from trillora.models.args import from_hf_config
        from trillora.models.params import shipped_config

        cfg = {**shipped_config(args.shape), "num_hidden_layers": args.layers}
        model = build_model(
            from_hf_config(cfg), device=args.device, dtype=torch.bfloat16 if args.precision == "bf16" else torch.float32
        )
        model.init_weights(std=0.02, generator=None)
    return model


def measure(args, service) -> dict:
    from trillora.serve.calls import SampleCall
    from trillora.serve.tinker.service import FwdBwd

    sid = service.create_session()
    models = [service.create_model(sid, k + 1, args.rank, ROLES, k)["model_id"] for k in range(args.adapters)]
    calls = []
    for k, m in enumerate(models):
        data = addition_rows(service, args.rows, k)
        calls.append(FwdBwd(m, "cross_entropy", {}, data, service.check_data("cross_entropy", {}, data), False))
    if args.ep == 1:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for m in models:  # B non-zero: each adapter really changes the model, differently
                for t in service.client(m).adapter.params.values():
                    t.copy_(torch.randn(t.shape, generator=g) * 0.05)
    else:  # the same on every rank: a step each
        for c in calls:
            service.forward_backward_many([c])
            service.optim_step(c.model_id, {"learning_rate": 5e-2})

    # --- the fused pass equals one pass per adapter -------------------------------------
    alone = [service.forward_backward_many([c])[0] for c in calls]
    want = grads(service, models)
    fused = service.forward_backward_many(calls)
    got = grads(service, models)
    logprob_diff, grad_diff = differences(alone, want, fused, got)
    # the rounding floor: the same adapter's rows in two passes instead of one (in bf16 a batch of
    # another size takes other kernels and rounds otherwise; fused should differ no more than this)
    split = []
    for c in calls:
        h = len(c.data) // 2
        parts = [
            service.forward_backward_many([FwdBwd(c.model_id, c.loss_fn, {}, c.data[s], c.tensors[s], False)])[0]
            for s in (slice(0, h), slice(h, None))
        ]
        split.append((parts[0][0] + parts[1][0], None))
    floor_logprob, floor_grad = differences(alone, want, split, grads(service, models))
    if args.ep > 1:  # a rank holds its block's gradients until optim_step sums them, and half a call's block
        floor_grad = None  # holds other datums than the whole call's: only the (gathered) logprobs compare

    # --- timing --------------------------------------------------------------------------
    def per_adapter():
        for c in calls:
            service.forward_backward_many([c])
        grads(service, models)

    def one_pass():
        service.forward_backward_many(calls)
        grads(service, models)

    samplers = [service.save_for_sampler(m, None, sid, k + 1)["sampling_session_id"] for k, m in enumerate(models)]
    prompt = service.tokenizer.encode("123+456=", add_special_tokens=False)
    params = {"max_tokens": args.max_tokens, "temperature": 1.0, "stop": []}  # no stop: every row runs max_tokens
    sample_calls = [SampleCall(s, prompt, args.samples, params) for s in samplers]
    times = {}
    for name, fn in track(
        [
            ("forward_backward, one pass per adapter", per_adapter),
            ("forward_backward, one pass", one_pass),
            ("sample, one generate per sampler", lambda: [service.sample_many([c]) for c in sample_calls]),
            ("sample, one generate", lambda: service.sample_many(sample_calls)),
        ],
        description="timing",
        transient=True,
    ):
        times[name] = timed(fn, args.device, args.reps)
    speedup = {
        "forward_backward": times["forward_backward, one pass per adapter"] / times["forward_backward, one pass"],
        "sample": times["sample, one generate per sampler"] / times["sample, one generate"],
    }
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    report = {
        "command": args.command,
        "model": f"{args.shape} ({args.layers} layers, random weights)" if args.shape else args.model,
        "expert_parallel_ranks": args.ep,
        "device": device_name,
        "precision": args.precision,
        "adapters": args.adapters,
        "rows": args.rows,
        "rank": args.rank,
        "samples": args.samples,
        "max_tokens": args.max_tokens,
        "reps": args.reps,
        "seconds_best_of_reps": times,
        "speedup_one_pass": speedup,
        "check": {
            "max_logprob_diff": logprob_diff,
            "max_grad_rel_diff": grad_diff,
            "floor_two_passes": {"max_logprob_diff": floor_logprob, "max_grad_rel_diff": floor_grad},
        },
    }
    ranks = f", experts over {args.ep} ranks" if args.ep > 1 else ""
    table = Table(
        title=f"{args.adapters} adapters × {args.rows} rows on one {report['model']} base ({device_name}, "
        f"{args.precision}{ranks})"
    )
    for col in ("work", "seconds (best of reps)"):
        table.add_column(col)
    for name, t in times.items():
        table.add_row(name, f"{t:.4f}")
    console = Console()
    console.print(table)
    console.print(
        f"one pass vs one per adapter: forward_backward {speedup['forward_backward']:.2f}×, "
        f"sample {speedup['sample']:.2f}×; fused = alone to {logprob_diff:.1e} (logprobs), "
        f"{grad_diff:.1e} (gradients, relative); one adapter's rows in two passes vs one: "
        f"{floor_logprob:.1e} / " + ("-" if floor_grad is None else f"{floor_grad:.1e}")
    )
    out = output_path(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
