"""Tinker training clients on one resident base: one after the other vs at once.

    python benchmarks/tinker_clients.py [--clients 2] [--steps 20] [--rows 16] [--rank 8] [--model tiny-moe-chat]

One `trillora serve --tinker` server (in this process, over HTTP on loopback) and the real
`tinker` SDK as the clients. Each client runs the same supervised loop (forward_backward with
cross_entropy on `--rows` 3-digit-addition rows, then optim_step). Modes: "sequential", each client
finishes before the next starts; "concurrent, unfused", all at once in threads, the server running
each request alone (`max_fused=1`); "concurrent", all at once with the server's default, requests
waiting together sharing one pass through the base (each row with its client's adapter).
Reported: wall-clock seconds of each mode and the ratios to sequential, how many passes were
shared, the base bytes resident (one copy, whatever the number of clients), each client's adapter
and AdamW bytes, and the process's peak resident memory.
Writes benchmarks/results/tinker_clients.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

os.environ.setdefault("TINKER_TELEMETRY", "0")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def start_server(model: str, state_dir: str, api_key: str = "tml-bench"):
    """`trillora serve MODEL --tinker` on a free loopback port, in a thread (`server.stop()` ends it)."""
    from trillora.serve.app import Server
    from trillora.serve.config import ServeConfig

    server = Server(
        ServeConfig(model=model, tinker=True, port=0, api_key=api_key, state_dir=state_dir, poll_seconds=5.0)
    )
    ready = threading.Event()
    threading.Thread(target=server.run, args=(ready,), daemon=True).start()
    ready.wait(120)
    return server


def batch(tokenizer, rows: int, seed: int):
    from tinker import types

    rng = random.Random(seed)
    data = []
    for _ in range(rows):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        prompt = tokenizer.encode(f"{a}+{b}=", add_special_tokens=False)
        answer = tokenizer.encode(str(a + b), add_special_tokens=False)
        tokens = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
            )
        )
    return data


def train(client_factory, data, steps: int, out: dict, name: str) -> None:
    from tinker import types

    tc = client_factory()
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=3e-3))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    out[name] = {"model_id": tc.model_id, "first_loss": losses[0], "last_loss": losses[-1]}


def main(argv: list[str] | None = None) -> dict:
    import tinker
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--model", default="tiny-moe-chat")
    p.add_argument("--state-dir", default=None)
    p.add_argument("--out", default=str(RESULTS / "tinker_clients.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    import tempfile

    state = args.state_dir or tempfile.mkdtemp(prefix="tinker-bench-")
    server = start_server(args.model, state)
    sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{server.cfg.port}", api_key="tml-bench")
    factory = lambda: sc.create_lora_training_client(base_model=args.model, rank=args.rank).result()  # noqa: E731
    tok = server.service.tokenizer
    names = [chr(ord("A") + i) for i in range(args.clients)]
    data = {n: batch(tok, args.rows, i + 1) for i, n in enumerate(names)}
    train(factory, data["A"], 2, {}, "warmup")  # first-call costs out of every mode

    times, results, fused = {}, {}, {}
    start = time.perf_counter()
    for name in names:
        train(factory, data[name], args.steps, results.setdefault("sequential", {}), name)
    times["sequential"] = time.perf_counter() - start
    for mode, max_fused in (("concurrent, unfused", 1), ("concurrent", server.cfg.max_fused)):
        server.worker.max_fused, before = max_fused, server.worker.fused_batches
        start = time.perf_counter()
        threads = [
            threading.Thread(target=train, args=(factory, data[n], args.steps, results.setdefault(mode, {}), n))
            for n in names
        ]
        [t.start() for t in threads]
        [t.join() for t in threads]
        times[mode] = time.perf_counter() - start
        fused[mode] = server.worker.fused_batches - before

    service = server.service
    base = sum(p.numel() * p.element_size() for n, p in service.base.model.named_parameters() if ".lora_" not in n)
    client = service.client(results["concurrent"]["A"]["model_id"]).adapter
    adapter = sum(p.numel() * p.element_size() for p in client.params.values())
    optim = sum(
        t.numel() * t.element_size() for s in client.optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    report = {
        "command": "python benchmarks/tinker_clients.py " + " ".join(argv or []),
        "model": args.model,
        "clients": args.clients,
        "steps": args.steps,
        "rows": args.rows,
        "rank": args.rank,
        "seconds": times,
        "shared_passes": fused,
        "ratio_sequential_over_concurrent": times["sequential"] / times["concurrent"],
        "ratio_sequential_over_concurrent_unfused": times["sequential"] / times["concurrent, unfused"],
        "base_bytes_resident": base,
        "base_copies": 1,
        "adapter_bytes_per_client": adapter,
        "adam_state_bytes_per_client": optim,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "runs": results,
    }
    table = Table(
        title=f"{args.clients} Tinker clients on one {args.model} base: {args.steps} steps × {args.rows} rows each"
    )
    for col in ("mode", "wall s", "sequential / mode", "shared passes", "A loss first → last"):
        table.add_column(col)
    for mode, r in results.items():
        table.add_row(
            mode,
            f"{times[mode]:.1f}",
            f"{times['sequential'] / times[mode]:.2f}×",
            str(fused.get(mode, 0)),
            f"{r['A']['first_loss']:.2f} → {r['A']['last_loss']:.2f}",
        )
    console = Console()
    console.print(table)
    console.print(
        f"base resident once: "
        f"{base / 2**20:.2f} MiB; per client: adapter {adapter / 2**20:.2f} MiB + AdamW {optim / 2**20:.2f} MiB; "
        f"peak RSS {report['peak_rss_bytes'] / 2**20:.0f} MiB"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
