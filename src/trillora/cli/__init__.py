"""`trillora` command line: `train`, `eval`, `generate`, `serve`, `traces`, `info`, `plan`, `plot`.

Each subcommand is a thin function over the library (`commands.py`, `info.py`, `plan.py`,
`traces.py`). Errors that are the user's to fix (`trillora.errors.TrilloraError`: a bad path, key
or value) print one line, not a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing

from ..errors import TrilloraError


def build_parser(serve_flags: bool = True) -> argparse.ArgumentParser:
    from ..lora.config import EXPERT_RANK_RULES
    from ..models.params import SHIPPED_CONFIGS
    from . import info, plan, traces
    from .commands import cmd_eval, cmd_generate, cmd_plot, cmd_serve, cmd_train

    parser = argparse.ArgumentParser(prog="trillora", description="RL on Mixture-of-Experts models through LoRA")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="parameter counts, structure and sizes of a model (no weights needed)")
    p.add_argument("model", help=f"shipped name ({', '.join(SHIPPED_CONFIGS)}), config.json or folder")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--lora-rank", type=int, default=0, help="also size a LoRA adapter of this rank")
    p.add_argument("--expert-rank-rule", default="same", choices=EXPERT_RANK_RULES)
    p.set_defaults(func=info.cmd_info)

    p = sub.add_parser("plan", help="parallel layout, memory and traffic per GPU for a model, workload and cluster")
    plan.add_arguments(p)
    p.set_defaults(func=plan.cmd_plan)

    p = sub.add_parser("train", help="RL through LoRA; with no arguments, the default job (tiny MoE + arithmetic)")
    p.add_argument("config", nargs="?", help="TOML config file (optional)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.temperature=0.8")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint (resume=true)")
    p.set_defaults(func=cmd_train)

    for name, helptext in (("generate", "sample completions"), ("eval", "held-out accuracy on a task")):
        p = sub.add_parser(name, help=helptext, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        p.add_argument("model", help="a shipped model (tiny-moe, tiny-moe-chat), a checkpoint folder or a Hub id")
        p.add_argument(
            "--adapter", help="an adapter folder trillora wrote: runs/<name>/adapter (its fused layout) or a layout's"
        )
        p.add_argument("--max-new-tokens", type=int, default=8, help="tokens a completion may have")
        p.add_argument("--temperature", type=float, default=0.0 if name == "generate" else 1.0, help="0 = greedy")
        p.add_argument("--seed", type=int, default=0, help="the sampler's seed")
        p.add_argument(
            "--trust-remote-code",
            action="store_true",
            help="run the tokenizer's own Python code (Kimi K2's tiktoken tokenizer); off by default",
        )
        if name == "generate":
            p.add_argument(
                "--prompt", required=True, help="text, encoded as the trainer encodes its prompts (BOS first)"
            )
            p.add_argument("-n", type=int, default=1, help="samples")
            p.set_defaults(func=cmd_generate)
        else:
            p.add_argument("--task", default="arithmetic")
            p.add_argument("--option", action="append", default=[], help="task option key=value")
            p.add_argument("--problems", type=int, default=512)
            p.add_argument("--samples", type=int, default=1)
            p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible completion server over the built-in engine; with --tinker "
        "the Tinker training API (the tinker SDK and tinker-cookbook as clients)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    if serve_flags:  # its flags are ServeConfig's fields (its imports cost a second: built when used)
        from ..serve.config import ServeConfig
        from .flags import add_flags

        add_flags(p, ServeConfig, skip=("dp", "pp_schedule", "pp_stage_layers"), positional=("model",))
        p.add_argument(
            "--learn",
            default=None,
            metavar="CONFIG",
            help="with --record: train the served policy on its rewarded traffic (a train TOML: [lora], "
            "[optim], [algorithm], [learn]) and serve each new revision as it is made",
        )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("traces", help="list, export (JSONL, Parquet) or delete what serve --record recorded")
    traces.add_arguments(p)
    p.set_defaults(func=traces.cmd_traces)

    p = sub.add_parser("plot", help="write the PNG plots of a run folder")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_plot)
    return parser


def entry() -> typing.NoReturn:
    """The process's entry (`trillora`, `python -m trillora`): a torchrun rank leaves without the
    interpreter's teardown (`leave_rank`); `main()` itself returns to its caller."""
    code = main()
    if "WORLD_SIZE" in os.environ:
        from ..policy.world import launched, leave_rank

        if launched():
            leave_rank(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(serve_flags=argv[:1] == ["serve"]).parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # a second Ctrl-C (the first asks `train` to stop after a checkpoint)
        print(f"trillora {args.command}: interrupted", file=sys.stderr)
        return 130
    except TrilloraError as e:
        if e.__cause__ is not None and getattr(e, "show_cause", False):  # the user's code: show where it failed
            import traceback

            traceback.print_exception(e.__cause__, file=sys.stderr)
        print(f"trillora {args.command}: error: {e}", file=sys.stderr)
        return 2
