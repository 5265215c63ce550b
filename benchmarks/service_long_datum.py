"""Peak memory per rank of one long datum's forward_backward on the Tinker service, by layout.

    python benchmarks/service_long_datum.py [--seq-len 4096] [--vocab 16384] [--out FILE]

Each layout runs in its own group of spawned gloo processes: `TinkerService` in one process, the
sharded service (`serve --tinker --cp / --tp / --sp / --vocab-parallel`) on 2 or 4. The base is
tiny-moe-chat's shape with a `--vocab`-token head and room for `--seq-len` positions, random
weights (the same on every rank); one client (rank 8, every role) runs one `cross_entropy` datum
of `--seq-len` tokens. Per rank, `trillora.plan.memory_probe.MemoryProbe` measures the peak of
live allocations during the call above where it began (the logits, their log-softmax and
gradients, the layers' activations; the base was allocated before), the largest rank reported.
At a large vocabulary the head's fp32 logits are most of it: cp keeps each rank's positions,
vocab_parallel each tp rank's slice of the vocabulary. The loss column shows every layout
computed the same thing. Ratios are against one process, from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
LAYOUTS = {
    "one process": {},
    "--cp 2": {"cp": 2},
    "--tp 2": {"tp": 2},
    "--tp 2 --vocab-parallel": {"tp": 2, "vocab_parallel": True},
    "--tp 2 --sp --vocab-parallel": {"tp": 2, "sp": True, "vocab_parallel": True},
    "--cp 2 --tp 2 --sp --vocab-parallel": {"cp": 2, "tp": 2, "sp": True, "vocab_parallel": True},
}
EVERY_ROLE = ("attention", "mlp", "shared_experts", "experts", "lm_head")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_model(seq_len: int, vocab: int):
    from trillora.checkpoint import resolve_model_path
    from trillora.models import build_model, from_hf_config

    config = json.loads((resolve_model_path("tiny-moe-chat") / "config.json").read_text())
    config.update(vocab_size=vocab, max_position_embeddings=max(seq_len, config["max_position_embeddings"]))
    model = build_model(from_hf_config(config, where="tiny-moe-chat"), device="cpu")
    model.init_weights(std=0.05, generator=torch.Generator().manual_seed(0))
    return model


def run(service, seq_len: int) -> tuple[int, float]:
    """One client, one datum: the peak above the call's start, and its loss."""
    import numpy as np

    from trillora.plan.memory_probe import MemoryProbe
    from trillora.serve.tinker.service import FwdBwd
    from trillora.serve.tinker.wire import Datum

    if service.ranks.rank > 0:  # the other ranks run rank 0's calls
        with MemoryProbe() as probe:
            service.follow()
        return probe.report.peak_bytes, float("nan")  # rank 0 reports the loss
    sid = service.create_session()
    model_id = service.create_model(sid, 1, 8, EVERY_ROLE, 7)["model_id"]
    ids = torch.randint(0, len(service.tokenizer), (seq_len + 1,), generator=torch.Generator().manual_seed(1)).numpy()
    data = [Datum(ids[:-1].tolist(), {"target_tokens": ids[1:], "weights": np.ones(seq_len, np.float32)})]
    call = FwdBwd(model_id, "cross_entropy", {}, data, service.check_data("cross_entropy", {}, data), False)
    with MemoryProbe() as probe:
        (outcome,) = service.forward_backward_many([call])
    service.stop()
    return probe.report.peak_bytes, outcome[1]["loss:sum"]


def worker(rank: int, world: int, port: int, flags: dict, seq_len: int, vocab: int, root: str, results) -> None:
    from trillora.parallel import ParallelDims
    from trillora.serve.config import ServeConfig
    from trillora.serve.tinker.service import TinkerService

    torch.set_num_threads(max(1, 2 // world))
    cfg = ServeConfig(model="tiny-moe-chat", state_dir=root, parallel=ParallelDims(dp=0, **flags))
    if not flags:
        service = TinkerService(cfg, model=base_model(seq_len, vocab))
        results.put((rank, *run(service, seq_len)))
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        service = TinkerService(cfg, model=base_model(seq_len, vocab))
        results.put((rank, *run(service, seq_len)))
    finally:
        dist.destroy_process_group()


def measure(name: str, flags: dict, seq_len: int, vocab: int, root: str) -> dict:
    world = flags.get("cp", 1) * flags.get("tp", 1)
    ctx = mp.get_context("forkserver")
    results = ctx.SimpleQueue()
    # forkserver, not spawn: its children end with os._exit, so gloo's threads cannot abort them in
    # the interpreter's teardown (see policy.world.leave_rank)
    mp.start_processes(
        worker, args=(world, free_port(), flags, seq_len, vocab, root, results), nprocs=world, start_method="forkserver"
    )
    rows = [results.get() for _ in range(world)]
    return dict(
        layout=name,
        ranks=world,
        seq_len=seq_len,
        vocab=vocab,
        peak_bytes=max(r[1] for r in rows),
        loss=next(r[2] for r in rows if r[0] == 0),
    )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.barh([r["layout"] for r in rows][::-1], [r["peak_bytes"] / 2**20 for r in rows][::-1])
    ax.set_xlabel("peak MiB per rank")
    ax.set_title(f"one {rows[0]['seq_len']}-token datum, vocabulary {rows[0]['vocab']}: forward_backward")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "service_long_datum.json")
    a = p.parse_args()
    console = Console()
    rows = []
    with console.status("measuring") as status, tempfile.TemporaryDirectory() as root:
        for name in a.layouts:
            status.update(f"{name}: one datum of {a.seq_len} tokens")
            rows.append(measure(name, LAYOUTS[name], a.seq_len, a.vocab, root))
    t = Table(title=f"peak memory per rank, one datum of {a.seq_len} tokens, vocabulary {a.vocab}, forward_backward")
    for col in ("layout", "ranks", "peak", "vs one process", "loss"):
        t.add_column(col, justify="right")
    for r in rows:
        r["ratio"] = r["peak_bytes"] / rows[0]["peak_bytes"]
        t.add_row(
            r["layout"], str(r["ranks"]), f"{r['peak_bytes'] / 2**20:.1f} MiB", f"{r['ratio']:.2f}×", f"{r['loss']:.4f}"
        )
    console.print(t)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=2))
    plot(rows, a.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
