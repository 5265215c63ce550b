"""Rollout throughput: LocalEngine vs transformers `generate` vs vLLM (`make setup-vllm`), same prompts.

    python benchmarks/rollout_throughput.py [--sequences 128] [--new-tokens 32] [--repeats 3]

A random 4-layer Qwen3-MoE (hidden 256, 8 experts top-2, the reference setup in DESIGN.md)
is written once as an HF folder; every engine samples `sequences` completions of exactly
`new-tokens` tokens (no stop token) from the same prompts at temperature 1, in fp32.
Generated tokens per second, median of the repeats after one warm-up, side by side; the results
file records the machine (CPU, threads, library versions, date).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from machine import machine
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from trillora.checkpoint import load_model, save_model
from trillora.models import build_model, from_hf_config
from trillora.rollout import LocalEngine, SamplingParams

CONFIG = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequences", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/rollout_throughput.json"))
    a = p.parse_args()
    torch.manual_seed(0)
    folder = Path(tempfile.mkdtemp()) / "qwen3moe-4l"
    model = build_model(from_hf_config(CONFIG), device="cpu")
    model.init_weights(std=0.05)
    save_model(model, folder)
    model = load_model(folder)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, CONFIG["vocab_size"], (a.sequences, a.prompt_len), generator=g)
    tokens = a.sequences * a.new_tokens
    rows = []

    engine = LocalEngine(model, precision="fp32")
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0)
    sec = timed(lambda: engine.generate(prompts.tolist(), 1, params), a.repeats)
    rows.append(("trillora LocalEngine (KV cache, fp32)", tokens / sec, sec))

    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def hf_generate():
        with torch.no_grad():
            hf.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=True,
                max_new_tokens=a.new_tokens,
                min_new_tokens=a.new_tokens,
                pad_token_id=0,
            )

    sec = timed(hf_generate, a.repeats)
    rows.append((f"transformers {transformers.__version__} generate", tokens / sec, sec))

    try:
        import vllm
    except ImportError:
        vllm = None
        rows.append(("vLLM (not installed: make setup-vllm)", float("nan"), float("nan")))
    else:
        from trillora.rollout.vllm import VLLMEngine

        engine = VLLMEngine(folder, model, sync="merged", max_model_len=a.prompt_len + a.new_tokens + 8)
        sec = timed(lambda: engine.generate(prompts.tolist(), 1, params), a.repeats)
        rows.append((f"vLLM {vllm.__version__} via VLLMEngine (fp32)", tokens / sec, sec))
        engine.close()

    table = Table(
        title=f"rollout throughput: {a.sequences} sequences × {a.new_tokens} new tokens, prompt {a.prompt_len}"
    )
    for col in ("engine", "tokens/s", "seconds", "vs transformers"):
        table.add_column(col, justify="right")
    base = rows[1][1]
    for name, tps, sec in rows:
        table.add_row(escape(name), f"{tps:,.0f}", f"{sec:.2f}", f"{tps / base:.2f}×")
    Console(width=140).print(table)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    libraries = [transformers] + ([vllm] if vllm is not None else [])
    a.out.write_text(
        json.dumps(
            {
                "rows": [{"engine": n, "tokens_per_s": t, "seconds": s} for n, t, s in rows],
                "machine": machine(torch, *libraries),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
