"""A pass through pipeline stages whole vs as row chunks in flight (`parallel.staged`, GPipe).

    python benchmarks/pipeline_microbatches.py [--stages 2] [--rows 32] [--tokens 128] [--chunks 1 2 4 8] [--reps 5]

What `serve --tinker --pp P --pp-microbatches M` runs for a forward_backward call: the rows
through P gloo ranks (one stage each, CPU, one thread per rank), the loss on the last stage,
backward back through the stages. With one chunk the stages work in turn; with M chunks stage s
works on chunk i while stage s+1 works on chunk i-1, forward and backward. Before timing, every
chunking's LoRA gradients are checked against the whole pass's. Tiny-moe-chat's weights with
LoRA (rank 8, every role, B non-zero). Writes benchmarks/results/pipeline_microbatches.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _rank(rank: int, args, port: int) -> None:
    import torch.distributed as dist

    from trillora import lora
    from trillora.checkpoint import load_model
    from trillora.parallel.staged import StagedModel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.stages)
    try:
        model = load_model(args.model)
        lora.apply_lora(
            model, lora.LoraConfig(rank=8, targets=("attention", "mlp", "shared_experts", "experts", "lm_head"))
        )
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _, p in lora.lora_parameters(model):
                p.normal_(0.0, 0.02, generator=g)
        staged = StagedModel(model, dist.group.WORLD, rank, args.stages)
        ids = torch.randint(
            0, model.args.vocab_size, (args.rows, args.tokens), generator=torch.Generator().manual_seed(1)
        )
        params = [p for p in staged.parameters() if p.requires_grad]

        def step(chunks: int) -> list[torch.Tensor]:
            staged.microbatches = chunks
            logits = staged(ids)
            loss = (
                torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).sum()
                if staged.last
                else None
            )
            staged.backward(loss)
            grads = [p.grad.clone() for p in params]
            for p in params:
                p.grad = None
            return grads

        whole = step(1)
        worst = 0.0
        for c in args.chunks:  # the same gradients, whatever the chunking
            worst = max(
                worst,
                max(
                    float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
                    for a, b in zip(step(c), whole, strict=True)
                ),
            )
        seconds = {}
        for c in args.chunks:
            step(c)  # warm-up
            best = float("inf")
            for _ in range(args.reps):
                dist.barrier()
                start = time.perf_counter()
                step(c)
                dist.barrier()
                best = min(best, time.perf_counter() - start)
            seconds[c] = best
        if rank == 0:
            report = {
                "command": args.command,
                "model": args.model,
                "stages": args.stages,
                "rows": args.rows,
                "tokens": args.tokens,
                "reps": args.reps,
                "seconds_best_of_reps": {str(c): t for c, t in seconds.items()},
                "speedup_over_whole": {str(c): seconds[1] / t for c, t in seconds.items()} if 1 in seconds else {},
                "max_grad_rel_diff_vs_whole": worst,
            }
            out = Path(args.out or RESULTS / "pipeline_microbatches.json")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2) + "\n")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    import torch.multiprocessing as mp
    from rich.console import Console
    from rich.table import Table

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-moe-chat")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.command = "python benchmarks/pipeline_microbatches.py " + " ".join(sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, str(ROOT / "tests"))
    from engine_helpers import free_port

    Console().print(f"{args.stages} stages, {args.rows} rows × {args.tokens} tokens: timing {args.chunks} chunks ...")
    # forkserver, not spawn: its children end with os._exit, so gloo's threads cannot abort them in
    # the interpreter's teardown (see policy.world.leave_rank)
    mp.start_processes(_rank, args=(args, free_port()), nprocs=args.stages, start_method="forkserver")
    report = json.loads(Path(args.out or RESULTS / "pipeline_microbatches.json").read_text())
    table = Table(title=f"forward + backward through {args.stages} stages ({args.model}, CPU, 1 thread per stage)")
    for col in ("chunks", "seconds (best of reps)", "speedup over the whole pass"):
        table.add_column(col)
    for c, t in report["seconds_best_of_reps"].items():
        table.add_row(c, f"{t:.3f}", f"{report['speedup_over_whole'].get(c, float('nan')):.2f}×")
    Console().print(table)
    Console().print(f"gradients equal the whole pass's to {report['max_grad_rel_diff_vs_whole']:.1e} (relative)")
    return report


if __name__ == "__main__":
    main()
