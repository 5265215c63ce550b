"""`trillora` command line: `train`, `eval`, `generate`, `serve`, `info`, `plan`, `plot`.

Each subcommand is a thin function over the library; errors that are the
user's to fix (a bad path, an unsupported config) print one line, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys


from .checkpoint import CheckpointError
from .checkpoint.train_state import CheckpointCorrupt
from .config import ConfigError as RunConfigError
from .lora import AdapterError, LoraConfigError
from .models import ConfigError
from .resume import TrainingDiverged
from .rollout.openai import EngineError
from .tasks import DatasetError
from .tasks.guard import RewardError


def lora_size(model_args, rank: int, rule: str) -> tuple[dict, int]:
    """Adapter size on the default targets (attention, dense MLP, shared and routed experts), on the meta device."""
    from . import lora
    from .models import build_model

    cfg = lora.LoraConfig(rank=rank, expert_rank_rule=rule)
    model = build_model(model_args, device="meta")
    lora.apply_lora(model, cfg)
    return lora.adapter_stats(model), cfg.rank_for_experts(model_args.top_k)


def cmd_info(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .info import count_params, human, human_bytes, resolve_args, structure

    model_args = resolve_args(args.model)
    counts = count_params(model_args)
    embed = model_args.vocab_size * model_args.hidden_size
    if args.json:
        print(json.dumps({
            "model_type": model_args.model_type,
            "total_params": counts.total,
            "activated_params": counts.activated,
            "activated_params_without_embedding": counts.activated - embed,
            "routed_expert_params": counts.routed_experts,
            "bytes_bf16": counts.bytes_bf16(),
            "bytes_fp8": counts.bytes_fp8(),
            "structure": dict(structure(model_args)),
            **({"lora": lora_size(model_args, args.lora_rank, args.expert_rank_rule)[0]} if args.lora_rank else {}),
        }, indent=2))
        return 0
    table = Table(title=f"trillora info: {args.model}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for label, value in structure(model_args):
        table.add_row(label, value)
    table.add_row("total parameters", f"{human(counts.total)} ({counts.total:,})")
    table.add_row("activated / token", f"{human(counts.activated)} ({human(counts.activated - embed)} without the input embedding)")
    table.add_row("routed experts", f"{human(counts.routed_experts)} ({100 * counts.routed_experts / counts.total:.1f}% of all)")
    table.add_row("weights at bf16", human_bytes(counts.bytes_bf16()))
    table.add_row("weights at fp8", human_bytes(counts.bytes_fp8()) + " (128×128 block scales, norms/embeddings bf16)")
    if args.lora_rank:
        stats, expert_rank = lora_size(model_args, args.lora_rank, args.expert_rank_rule)
        table.add_row(
            f"LoRA rank {args.lora_rank}",
            f"{human(stats['adapter_params'])} params, {human_bytes(stats['adapter_bytes'])} fp32 "
            f"({100 * stats['fraction']:.2f}% of the base; expert rank {expert_rank})",
        )
    Console().print(table)
    return 0


def _policy(model_path: str, adapter: str | None):
    """Model (+ adapter) and tokenizer; `tiny-moe` names the shipped checkpoint."""
    from . import lora
    from .checkpoint import load_model, load_tokenizer
    from .train import resolve_model_path

    path = resolve_model_path(model_path)
    model = load_model(path)
    if adapter:
        lora.load_adapter(model, adapter)
    return model, load_tokenizer(path)


def cmd_generate(args: argparse.Namespace) -> int:
    from .evaluate import decode_completion, encode_prompt
    from .rollout import LocalEngine, SamplingParams

    model, tokenizer = _policy(args.model, args.adapter)
    engine = LocalEngine(model, precision="fp32")
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, stop_token_ids=stop)
    for c in engine.generate([encode_prompt(tokenizer, args.prompt)], args.n, params)[0]:
        print(args.prompt + decode_completion(tokenizer, c.token_ids))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .evaluate import evaluate
    from .rollout import LocalEngine, SamplingParams
    from .tasks import make_task

    model, tokenizer = _policy(args.model, args.adapter)
    engine = LocalEngine(model, precision="fp32")
    from .config import parse_override

    options = {".".join(keys): value for keys, value in map(parse_override, args.option)}  # values read as TOML
    task = make_task(args.task, **options)
    problems = task.problems("eval", args.problems, seed=args.seed)
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, stop_token_ids=stop)
    acc = evaluate(engine, tokenizer, task, problems, params, n=args.samples)
    print(json.dumps({"task": args.task, "accuracy": acc, "problems": args.problems, "samples": args.samples,
                      "temperature": args.temperature}))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .config import load_config
    from .train import train

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # `trillora train key=value ...` without a file
        overrides.insert(0, config)
        config = None
    if args.resume:
        overrides.append("resume=true")
    summary = train(load_config(config, overrides))
    if summary:  # under torchrun only rank 0 reports
        print(json.dumps({k: v for k, v in summary.items() if k != "adapter"}, indent=2))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .rollout.serve import ServeConfig, serve

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"trillora serve: warning: listening on {args.host} without --api-key", file=sys.stderr)
    serve(ServeConfig(model=args.model, host=args.host, port=args.port, api_key=args.api_key,
                      adapter_root=args.adapter_root, precision=args.precision, max_connections=args.max_connections))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from .plots import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from .parallel import plan_report

    try:
        out = plan_report.run(args)
    except ValueError as e:  # no layout divides this model / workload / world size
        print(f"trillora plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        plan_report.render(out)
    return 0 if out.get("fits") else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trillora", description="RL on Mixture-of-Experts models through LoRA")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="parameter counts, structure and sizes of a model (no weights needed)")
    p.add_argument("model", help="shipped name (kimi-k2, deepseek-v3, qwen3-30b-a3b, qwen3-235b-a22b), config.json or folder")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--lora-rank", type=int, default=0, help="also size a LoRA adapter of this rank")
    p.add_argument("--expert-rank-rule", default="same", choices=("same", "divide_by_top_k"))
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("plan", help="parallel layout, memory and traffic per GPU for a model, workload and cluster")
    from .parallel.plan_report import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("train", help="RL through LoRA; with no arguments, the default job (tiny MoE + arithmetic)")
    p.add_argument("config", nargs="?", help="TOML config file (optional)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.temperature=0.8")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint (resume=true)")
    p.set_defaults(func=cmd_train)

    for name, helptext in (("generate", "sample completions"), ("eval", "held-out accuracy on a task")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("model", help="Hugging Face checkpoint folder, or tiny-moe")
        p.add_argument("--adapter", help="adapter folder saved by trillora (either layout)")
        p.add_argument("--max-new-tokens", type=int, default=8)
        p.add_argument("--temperature", type=float, default=0.0 if name == "generate" else 1.0, help="0 = greedy")
        p.add_argument("--seed", type=int, default=0)
        if name == "generate":
            p.add_argument("--prompt", required=True)
            p.add_argument("-n", type=int, default=1, help="samples")
            p.set_defaults(func=cmd_generate)
        else:
            p.add_argument("--task", default="arithmetic")
            p.add_argument("--option", action="append", default=[], help="task option key=value")
            p.add_argument("--problems", type=int, default=512)
            p.add_argument("--samples", type=int, default=1)
            p.set_defaults(func=cmd_eval)

    p = sub.add_parser("serve", help="OpenAI-compatible completion server over the built-in engine")
    p.add_argument("model", help="Hugging Face checkpoint folder, or tiny-moe")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--adapter-root", default=None, help="folder adapters may be loaded from (load_lora_adapter)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16_weights", "bf16"))
    p.add_argument("--max-connections", type=int, default=64, help="connections served at once; more wait")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("plot", help="write the PNG plots of a run folder")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, RunConfigError, CheckpointError, AdapterError, LoraConfigError, DatasetError,
            FileNotFoundError, KeyError, TrainingDiverged, CheckpointCorrupt, RewardError, EngineError) as e:
        if isinstance(e, RewardError) and e.__cause__ is not None:  # the user's code: show where it failed
            import traceback

            traceback.print_exception(e.__cause__, file=sys.stderr)
        print(f"trillora {args.command}: error: {e}", file=sys.stderr)
        return 2
