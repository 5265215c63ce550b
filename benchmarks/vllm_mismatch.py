"""Rollout/training mismatch: each engine samples, the trainer (fp32) rescores the same tokens.

    python benchmarks/vllm_mismatch.py [--adapter runs/default/adapter/per_expert] [--prompts 64]

The shipped tiny MoE (optionally with a trained adapter, merged into each engine), the
default job's prompts (3-digit addition, 8 samples each, T=1, up to 6 new tokens). For each
engine the table shows the metrics the trainer logs every step: the mismatch KL (k3), the
spread of the per-token ratio ρ = π_train / π_rollout, the share of tokens truncated IS
would cap at 2, and the largest |Δ logprob|. The vLLM rows are the real-world mismatch
TIS corrects (fp32 and bf16 weights and compute on this CPU).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from trillora import lora, rl
from trillora.checkpoint import load_model, load_tokenizer, resolve_model_path
from trillora.config import TrainConfig
from trillora.envs.trajectory import Sample
from trillora.policy.logprobs import token_logprobs
from trillora.rollout import LocalEngine, SamplingParams
from trillora.tasks import make_task
from trillora.tasks.prompts import encode_prompt
from trillora.trainer.batch import batch_from_samples


def score(model, groups) -> tuple[dict, float]:
    flat = [c for g in groups for c in g]
    batch = batch_from_samples([Sample.single_turn(c.prompt_ids, c.token_ids, c.logprobs) for c in flat], 0, "cpu")
    with torch.no_grad():
        trainer, _ = token_logprobs(model, batch.input_ids, 1.0)  # [B, T]
    _, metrics = rl.mismatch_weights(trainer, batch.rollout_logprobs, batch.completion_mask, "token_tis", 2.0)
    m = batch.completion_mask.bool()
    return metrics, float((trainer - batch.rollout_logprobs)[m].abs().max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapter", type=Path, default=None, help="a saved adapter folder (per_expert or fused)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm_mismatch.json"))
    a = p.parse_args()
    path = resolve_model_path("tiny-moe")
    tok = load_tokenizer(path)
    model = load_model(path)
    if a.adapter:
        lora.load_adapter(model, a.adapter)  # adds the adapter's own targets and ranks
    else:
        lora.apply_lora(model, TrainConfig().lora)  # B = 0: the base weights
    problems = make_task("arithmetic").problems("eval", a.prompts, seed=0)
    prompts = [encode_prompt(tok, q.prompt) for q in problems]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=0, stop_token_ids=(tok.eos_token_id,))
    rows = []
    for precision in ("fp32", "bf16_weights"):
        engine = LocalEngine(model, precision=precision)
        rows.append((f"trillora LocalEngine {precision}", *score(model, engine.generate(prompts, a.samples, params))))
    try:
        import vllm
    except ImportError:
        rows.append(("vLLM (not installed: make setup-vllm)", {}, float("nan")))
    else:
        from trillora.rollout.vllm import VLLMEngine

        for dtype in ("float32", "bfloat16"):
            engine = VLLMEngine(path, model, sync="merged", dtype=dtype, max_model_len=128)
            engine.sync(model)
            rows.append(
                (f"vLLM {vllm.__version__} {dtype}", *score(model, engine.generate(prompts, a.samples, params)))
            )
            engine.close()
    table = Table(
        title=f"mismatch vs the fp32 trainer: {a.prompts} prompts × {a.samples} samples"
        f"{' + ' + str(a.adapter) if a.adapter else ' (base weights)'}"
    )
    for col in ("rollout engine", "KL k3", "ρ min", "ρ max", "ρ > 2 (TIS caps)", "max |Δ logprob|"):
        table.add_column(col, justify="right")
    for name, m, d in rows:
        if not m:
            table.add_row(name, "-", "-", "-", "-", "-")
            continue
        table.add_row(
            name,
            f"{m['mismatch_kl_k3']:.2e}",
            f"{m['is_ratio_min']:.4f}",
            f"{m['is_ratio_max']:.4f}",
            f"{m['is_limited_frac']:.2%}",
            f"{d:.2e}",
        )
    Console(width=140).print(table)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps([{"engine": n, **m, "max_abs_logprob_diff": d} for n, m, d in rows], indent=2))


if __name__ == "__main__":
    main()
