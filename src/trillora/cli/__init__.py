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
from ..rollout.types import Precision


def build_parser() -> argparse.ArgumentParser:
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
        p = sub.add_parser(name, help=helptext)
        p.add_argument("model", help="Hugging Face checkpoint folder, or tiny-moe")
        p.add_argument("--adapter", help="adapter folder saved by trillora (either layout)")
        p.add_argument("--max-new-tokens", type=int, default=8)
        p.add_argument("--temperature", type=float, default=0.0 if name == "generate" else 1.0, help="0 = greedy")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument(
            "--trust-remote-code",
            action="store_true",
            help="run the tokenizer's own Python code (Kimi K2's tiktoken tokenizer); off by default",
        )
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

    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible completion server over the built-in engine; with --tinker "
        "the Tinker training API (the tinker SDK and tinker-cookbook as clients)",
    )
    p.add_argument("model", help="Hugging Face checkpoint folder, or tiny-moe")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require the key on every route but /health: "
        "'Authorization: Bearer KEY' or 'X-API-Key: KEY'; repeat for several keys (each key's traces are its own)",
    )
    p.add_argument(
        "--record",
        default=None,
        metavar="STORE",
        help="record every OpenAI completion (token ids, logprobs, "
        "revision, trace id) in this trace store: a SQLite file or a postgresql:// URL; /v1/feedback scores traces",
    )
    p.add_argument(
        "--learn",
        default=None,
        metavar="CONFIG",
        help="with --record: train the served policy on its rewarded "
        "traffic (a train TOML: [lora], [optim], [algorithm], [learn]) and serve each new revision as it is made",
    )
    p.add_argument("--tinker", action="store_true", help="serve the Tinker REST API: LoRA training clients on one base")
    p.add_argument(
        "--state-dir",
        default="tinker-state",
        help="--tinker: where saved states and sampler weights go (default: tinker-state in the working folder)",
    )
    p.add_argument("--max-clients", type=int, default=16, help="--tinker: training clients held at once")
    p.add_argument("--max-samplers", type=int, default=256, help="--tinker: sampling sessions held at once")
    p.add_argument(
        "--max-sessions",
        type=int,
        default=256,
        help="--tinker: sessions held at once (one not heard from for 5 minutes is ended and freed)",
    )
    p.add_argument(
        "--max-futures",
        type=int,
        default=1024,
        help="--tinker: requests one key may hold queued or not yet retrieved (past it: 429)",
    )
    p.add_argument(
        "--max-unread-mib",
        type=int,
        default=1024,
        help="--tinker: a key's results not yet retrieved hold at most this much (its oldest are dropped)",
    )
    p.add_argument(
        "--max-state-gib",
        type=float,
        default=64.0,
        help="--tinker: saved states under --state-dir hold at most this much (a save past it is refused)",
    )
    p.add_argument("--idle-seconds", type=float, default=60.0, help="a connection may wait this long before a request")
    p.add_argument("--header-seconds", type=float, default=10.0, help="from a request's first byte to its headers' end")
    p.add_argument("--body-seconds", type=float, default=60.0, help="for a request's whole body")
    p.add_argument(
        "--max-call-tokens",
        type=int,
        default=65536,
        help="tokens one call may hold: a forward_backward's datums, or n × (prompt + max_tokens) of a sample",
    )
    p.add_argument("--device", default="cpu", help="--tinker: where the base and the adapters live (cpu, cuda)")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="--tinker under torchrun: split attention and dense MLP layers "
        "(and the clients' adapters on them) over groups of TP ranks",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="--tinker under torchrun: shard the routed experts (and the "
        "clients' expert adapters) over groups of EP ranks",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        help="--tinker under torchrun: split the decoder layers into PP "
        "pipeline stages, one per rank of a pipeline group",
    )
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="--tinker under torchrun: split each row of a training pass "
        "over CP ranks (context parallelism, for long traces)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="--tinker under torchrun: shard the frozen base over the "
        "data-parallel ranks (FSDP2), gathered layer by layer",
    )
    p.add_argument(
        "--sp",
        action="store_true",
        help="--tinker --tp: sequence parallelism (norms and the residual stream split over the sequence)",
    )
    p.add_argument(
        "--vocab-parallel",
        action="store_true",
        help="--tinker --tp: split the head over the vocabulary; losses never hold the full logits",
    )
    p.add_argument(
        "--pp-microbatches",
        type=int,
        default=1,
        help="--tinker --pp: a pass's rows in this many chunks in flight, so the stages overlap",
    )
    p.add_argument(
        "--expert-rank-rule",
        default="same",
        choices=EXPERT_RANK_RULES,
        help="--tinker: each client's routed-expert adapters at its rank, or at rank // top_k",
    )
    p.add_argument(
        "--activation-checkpoint-every",
        type=int,
        default=0,
        help="--tinker: recompute every k-th decoder layer in backward instead of keeping its activations",
    )
    p.add_argument(
        "--max-fused",
        type=int,
        default=16,
        help="--tinker: waiting requests (of several clients) sharing one pass through the base; 1: never",
    )
    p.add_argument("--adapter-root", default=None, help="folder adapters may be loaded from (load_lora_adapter)")
    p.add_argument(
        "--adapter-memory-mib",
        type=float,
        default=None,
        help="memory the loaded adapters may hold together (default: half of what is free once the base is loaded)",
    )
    p.add_argument(
        "--precision", default="fp32", choices=[c for c in typing.get_args(Precision) if c not in ("auto", "policy")]
    )
    p.add_argument(
        "--max-connections", type=int, default=512, help="connections open at once; the next is answered 503"
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the tokenizer's own Python code (Kimi K2's tiktoken tokenizer); off by default",
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
        from ..trainer.world import launched, leave_rank

        if launched():
            leave_rank(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
