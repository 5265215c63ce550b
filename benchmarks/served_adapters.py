"""Many adapters on one resident base under `trillora serve` (the OpenAI routes), with the `openai` SDK as client.

Two measurements, side by side in one run on one server:
- memory: the server's resident memory (RSS) with 1 and with N loaded adapters (rank-r PEFT
  folders, `/v1/load_lora_adapter`); each adapter is its tensors in the base's slots, not a copy;
- throughput: C client threads, each sampling its own adapter through `/v1/completions` at once,
  with waiting requests sharing one pass (each row its own adapter) against one request at a time
  (`max_fused=1`). Completions are unseeded (seeded requests are sampled alone, to stay reproducible).

Writes benchmarks/results/served_adapters.json and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
KEY = "bench-key"


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no VmRSS")


def save_adapters(model_name: str, folder: Path, count: int, rank: int) -> int:
    """`count` different rank-`rank` adapters (B drawn too, so each one changes the samples); their bytes each."""
    import torch

    from trillora import lora
    from trillora.checkpoint import load_model, resolve_model_path

    model = load_model(resolve_model_path(model_name))
    lora.apply_lora(model, lora.LoraConfig(rank=rank))
    size = 0
    for i in range(count):
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for _, p in lora.lora_parameters(model):
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        lora.save_adapter(model, folder / f"a{i}")
        size = sum(p.numel() * p.element_size() for _, p in lora.lora_parameters(model))
    return size


def client(url: str, model: str, prompts: list[str], max_tokens: int, out: list) -> None:
    from openai import OpenAI

    api = OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
    for p in prompts:
        r = api.completions.create(
            model=model, prompt=p, max_tokens=max_tokens, temperature=1.0, extra_body={"ignore_eos": True}
        )
        out.append(r.usage.completion_tokens)


def main(argv: list[str] | None = None) -> dict:
    import torch

    from trillora.serve.app import Server
    from trillora.serve.config import ServeConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-moe")
    p.add_argument("--adapters", type=int, default=32, help="adapters loaded for the memory figure")
    p.add_argument("--clients", type=int, default=8, help="client threads, each on its own adapter")
    p.add_argument("--requests", type=int, default=8, help="completions per client")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--out", default=str(RESULTS / "served_adapters.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    root = Path(tempfile.mkdtemp(prefix="served-adapters-"))
    adapter_bytes = save_adapters(args.model, root, max(args.adapters, args.clients), args.rank)
    server = Server(ServeConfig(model=args.model, port=0, api_key=KEY, adapter_root=str(root)))
    ready = threading.Event()
    threading.Thread(target=server.run, args=(ready,), daemon=True).start()
    ready.wait(120)
    url = f"http://127.0.0.1:{server.cfg.port}"
    from openai import OpenAI

    api = OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)

    def load(i: int) -> None:
        api.post("/load_lora_adapter", body={"lora_name": f"a{i}", "lora_path": f"a{i}"}, cast_to=object)

    load(0)
    client(url, "a0", ["12+34="] * 2, args.max_tokens, [])  # warm: first-call costs out of every figure
    rss_one = rss_bytes()
    for i in range(1, args.adapters):
        load(i)
    client(url, "a1", ["12+34="], args.max_tokens, [])
    rss_all = rss_bytes()
    listed = api.models.list()

    # the shorter range sets the count (13 prompts)
    prompts = [f"{a}+{b}=" for a, b in zip(range(11, 99, 7), range(23, 99, 5), strict=False)][: args.requests]
    seconds, tokens, fused = {}, {}, {}
    for mode, max_fused in (("one request at a time", 1), ("waiting requests share a pass", server.cfg.max_fused)):
        server.worker.max_fused, before = max_fused, server.worker.fused_batches
        outs = [[] for _ in range(args.clients)]
        threads = [
            threading.Thread(target=client, args=(url, f"a{c}", prompts, args.max_tokens, outs[c]))
            for c in range(args.clients)
        ]
        start = time.perf_counter()
        [t.start() for t in threads]
        [t.join() for t in threads]
        seconds[mode] = time.perf_counter() - start
        tokens[mode] = sum(sum(o) for o in outs)
        fused[mode] = server.worker.fused_batches - before
    server.stop()

    alone, shared = (seconds[m] for m in seconds)
    report = {
        "command": "python benchmarks/served_adapters.py " + " ".join(argv or []),
        "model": args.model,
        "rank": args.rank,
        "adapters": args.adapters,
        "clients": args.clients,
        "requests_per_client": args.requests,
        "max_tokens": args.max_tokens,
        "adapter_bytes": adapter_bytes,
        "base_bytes": server.openai.base_bytes,
        "rss_one_adapter_bytes": rss_one,
        "rss_all_adapters_bytes": rss_all,
        "rss_ratio": rss_all / rss_one,
        "models_listed": len(listed.data),
        "seconds": seconds,
        "completion_tokens": tokens,
        "shared_passes": fused,
        "tokens_per_second": {m: tokens[m] / seconds[m] for m in seconds},
        "speedup_shared": alone / shared,
    }
    table = Table(
        title=f"{args.clients} clients × {args.requests} completions × {args.max_tokens} tokens, "
        f"each client its own rank-{args.rank} adapter, {args.model}"
    )
    for col in ("mode", "wall s", "tokens/s", "shared passes"):
        table.add_column(col)
    for m in seconds:
        table.add_row(m, f"{seconds[m]:.1f}", f"{report['tokens_per_second'][m]:.0f}", str(fused[m]))
    console = Console()
    console.print(table)
    console.print(
        f"sharing a pass: {report['speedup_shared']:.2f}×; resident memory with {args.adapters} adapters "
        f"{rss_all / 2**20:.0f} MiB vs 1 adapter {rss_one / 2**20:.0f} MiB ({report['rss_ratio']:.3f}×; "
        f"an adapter is {adapter_bytes / 2**20:.2f} MiB, the base {report['base_bytes'] / 2**20:.2f} MiB)"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    plot(report, Path(args.out).with_suffix(".png"))
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    modes = list(report["tokens_per_second"])
    ax1.bar(["alone", "shared pass"], [report["tokens_per_second"][m] for m in modes], color=["#999", "#2a7"])
    ax1.set_ylabel("completion tokens / s")
    ax1.set_title(f"{report['clients']} clients, {report['clients']} adapters")
    ax2.bar(
        ["1 adapter", f"{report['adapters']} adapters"],
        [report["rss_one_adapter_bytes"] / 2**20, report["rss_all_adapters_bytes"] / 2**20],
        color=["#999", "#27a"],
    )
    ax2.set_ylabel("server RSS (MiB)")
    ax2.set_title(f"resident memory: {report['rss_ratio']:.3f}×")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
