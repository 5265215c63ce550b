"""`python -m trillora.tiny build [OUT]` / `build-chat [OUT]` / `build-memory OUT` / `build-family OUT` /
`random OUT`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..checkpoint import resolve_model_path
from . import __doc__ as DOC
from . import write_random_checkpoint
from .memory_rows import EPISODES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trillora.tiny", description=DOC, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="pretrain the tiny MoE and write it (default: the shipped folder)")
    b.add_argument("out", type=Path, nargs="?", default=None)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--max-steps", type=int, default=6000)
    c = sub.add_parser(
        "build-chat", help="pretrain the chat variant with tool calls (default: the shipped tiny-moe-chat)"
    )
    c.add_argument("out", type=Path, nargs="?", default=None)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--max-steps", type=int, default=1500)
    m = sub.add_parser(
        "build-memory",
        help="tiny-moe taught to read a ledger or registers (the starting point for memory "
        "benchmarks); written to OUT, not into the package",
    )
    m.add_argument("out", type=Path)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--max-steps", type=int, default=2000)
    m.add_argument("--target-success", type=float, default=0.8)
    m.add_argument("--induction-steps", type=int, default=1500, help="most steps of the lookup phase (0: none)")
    m.add_argument(
        "--memory-rows", type=int, default=24, help="rows per batch teaching refills and recall: (0: the env alone)"
    )
    m.add_argument(
        "--env",
        choices=tuple(EPISODES),
        default="ledger",
        help="the long-horizon env taught (trillora.envs.ledger or trillora.envs.registers)",
    )
    m.add_argument(
        "--refill-context",
        action="store_true",
        help="refill rows hold the context after their chunk (memory.refill_context = true)",
    )
    f = sub.add_parser(
        "build-family",
        help="the tiny recipe at several widths, each pretrained on the same data "
        "for a fixed number of tokens per parameter (OUT/w<width>)",
    )
    f.add_argument("out", type=Path)
    f.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256])
    f.add_argument("--tokens-per-param", type=float, default=2.0)
    f.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("random", help="random weights, same architecture and tokenizer")
    r.add_argument("out", type=Path)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--dense", action="store_true", help="no experts (a dense Qwen3 of the same shapes)")
    r.add_argument("--chat", action="store_true", help="the chat variant's tokenizer and template")
    args = parser.parse_args(argv)
    if args.command == "random":
        print(write_random_checkpoint(args.out, seed=args.seed, dense=args.dense, chat=args.chat))
        return 0
    if args.command == "build-family":
        from ..models import build_model, from_hf_config
        from . import tiny_config
        from .pretrain import pretrain

        for width in args.widths:
            shape = from_hf_config(dict(tiny_config(width), vocab_size=100), where=f"width {width}")
            params = sum(p.numel() for p in build_model(shape, device="meta").parameters())
            out = args.out / f"w{width}"
            report = pretrain(out, seed=args.seed, width=width, tokens=int(args.tokens_per_param * params))
            report["params"] = params
            (out / "pretrain_report.json").write_text(json.dumps(report, indent=2))
            print(
                f"wrote {out}: {params / 1e6:.2f}M parameters, {report['tokens']} tokens, {report['steps']} steps, "
                f"{report['seconds']:.0f} s, last eval {report['history'][-1]}"
            )
        return 0
    if args.command == "build-memory":
        from .memory import pretrain_memory

        out = args.out
        report = pretrain_memory(
            out,
            seed=args.seed,
            max_steps=args.max_steps,
            target_success=args.target_success,
            induction_steps=args.induction_steps,
            memory_rows=args.memory_rows,
            env_name=args.env,
            refill_context=args.refill_context,
        )
    elif args.command == "build-chat":
        from .chat import pretrain_chat

        out = args.out or resolve_model_path("tiny-moe-chat")
        report = pretrain_chat(out, seed=args.seed, max_steps=args.max_steps)
    else:
        from .pretrain import pretrain

        out = args.out or resolve_model_path("tiny-moe")
        report = pretrain(out, seed=args.seed, max_steps=args.max_steps)
    (Path(out) / "pretrain_report.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out}: {report['steps']} steps, {report['seconds']:.0f} s, last eval {report['history'][-1:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
