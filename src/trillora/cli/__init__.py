"""`trillora` command line: `train`, `eval`, `generate`, `serve`, `traces`, `info`, `plan`, `plot`.

Each subcommand is a thin function over the library. Errors that are the user's to fix
(`trillora.errors.TrilloraError`: a bad path, key or value) print one line, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing

from ..errors import ConfigError, TrilloraError
from ..rollout.types import Precision


def _policy(model_path: str, adapter: str | None, trust_remote_code: bool = False):
    """Model (+ adapter) and tokenizer; `tiny-moe` names the shipped checkpoint."""
    from .. import lora
    from ..checkpoint import check_tokenizer_fits, load_model, load_tokenizer

    tokenizer = load_tokenizer(model_path, trust_remote_code=trust_remote_code)
    model = load_model(model_path)
    check_tokenizer_fits(tokenizer, model.args.vocab_size, model_path)
    if adapter:
        lora.load_adapter(model, adapter)
    return model, tokenizer


def _sampling(tokenizer, args: argparse.Namespace):
    from ..rollout import SamplingParams

    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                          stop_token_ids=stop)


def cmd_generate(args: argparse.Namespace) -> int:
    from ..rollout import LocalEngine
    from ..tasks.prompts import decode_completion, encode_prompt

    model, tokenizer = _policy(args.model, args.adapter, args.trust_remote_code)
    engine = LocalEngine(model, precision="fp32")
    for c in engine.generate([encode_prompt(tokenizer, args.prompt)], args.n, _sampling(tokenizer, args))[0]:
        print(args.prompt + decode_completion(tokenizer, c.token_ids))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from ..config import parse_override
    from ..rollout import LocalEngine
    from ..tasks import make_task
    from ..trainer.evaluate import evaluate

    model, tokenizer = _policy(args.model, args.adapter, args.trust_remote_code)
    engine = LocalEngine(model, precision="fp32")
    options = {".".join(keys): value for keys, value in map(parse_override, args.option)}  # values read as TOML
    task = make_task(args.task, **options)
    problems = task.problems("eval", args.problems, seed=args.seed)
    acc = evaluate(engine, tokenizer, task, problems, _sampling(tokenizer, args), n=args.samples)
    print(json.dumps({"task": args.task, "accuracy": acc, "problems": args.problems, "samples": args.samples,
                      "temperature": args.temperature}))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..trainer import train

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
    from ..serve.app import Server
    from ..serve.config import ServeConfig
    from ..trainer.world import launched

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"trillora serve: warning: listening on {args.host} without --api-key", file=sys.stderr)
    cfg = ServeConfig(model=args.model, tinker=args.tinker, host=args.host, port=args.port, api_key=args.api_key,
                      state_dir=args.state_dir, adapter_root=args.adapter_root, adapter_memory_mib=args.adapter_memory_mib,
                      max_connections=args.max_connections, max_clients=args.max_clients, max_samplers=args.max_samplers,
                      max_sessions=args.max_sessions, max_call_tokens=args.max_call_tokens, device=args.device,
                      idle_seconds=args.idle_seconds, header_seconds=args.header_seconds, body_seconds=args.body_seconds,
                      precision=args.precision, max_fused=args.max_fused, trust_remote_code=args.trust_remote_code,
                      tp=args.tp, ep=args.ep, pp=args.pp, cp=args.cp, sp=args.sp, fsdp=args.fsdp,
                      vocab_parallel=args.vocab_parallel, pp_microbatches=args.pp_microbatches,
                      expert_rank_rule=args.expert_rank_rule, activation_checkpoint_every=args.activation_checkpoint_every,
                      record=args.record)
    if args.learn and not args.record:
        raise ConfigError("--learn trains on recorded traffic: give --record STORE too")
    if launched():
        if args.learn:
            raise ConfigError("--learn runs in one process (not under torchrun) for now")
        return _serve_parallel(cfg)
    if _sharded(cfg):
        raise SystemExit(f"trillora serve {_layout(cfg)}: a sharded base needs several ranks; launch "
                         f"with torchrun --nproc-per-node N (N a multiple of {cfg.tp * cfg.pp * cfg.cp * cfg.ep})")
    server = Server(cfg)
    if args.learn:
        start_learning(server, args.learn)
    server.run()
    return 0


def start_learning(server, config_path: str, poll_seconds: float = 1.0):
    """`--learn CONFIG`: a learner on the server's base, publishing revisions as its traffic is rewarded."""
    from pathlib import Path

    from ..config import load_config
    from ..policy.adapters import SLOT_ROLES
    from ..serve.revisions import Revisions
    from ..trainer.learner import Learner

    train = load_config(config_path)
    if train.lora.patterns or train.lora.exclude or not set(train.lora.targets) <= set(SLOT_ROLES):
        raise ConfigError(f"{config_path}: [lora] of a learning server adapts whole roles of {list(SLOT_ROLES)} "
                          f"(no patterns or exclude); got targets={list(train.lora.targets)}")
    revisions = Revisions(server.service, train.learn.publish_as or server.cfg.model, train.learn.keep)
    server.app.include_router(revisions.router)
    service = server.service
    learner = Learner(service.base, server.openai.recorder.store, train, revisions.publish,
                      Path(server.cfg.state_dir) / "learner", service.device, service.tokenizer)
    revisions.attach(learner, server.worker, poll_seconds)
    server.revisions = revisions
    return revisions


def _sharded(cfg) -> bool:
    return cfg.ep > 1 or cfg.tp > 1 or cfg.pp > 1 or cfg.cp > 1 or cfg.fsdp


def _tp_extras(cfg) -> str:
    extras = [what for what, on in (("sequence-parallel norms", cfg.sp), ("the head over the vocabulary", cfg.vocab_parallel)) if on]
    return f" ({', '.join(extras)})" if extras else ""


def _layout(cfg) -> str:
    return f"--tp {cfg.tp} --ep {cfg.ep} --pp {cfg.pp} --cp {cfg.cp}" + (" --fsdp" if cfg.fsdp else "")


def _serve_parallel(cfg) -> int:
    """Under torchrun: every rank holds the base (split with --tp / --ep / --pp) and the clients' adapters;
    rank 0 serves HTTP (`serve.ranks`)."""
    import dataclasses
    import gc

    import torch.distributed as dist

    from ..serve.tinker_service import TinkerService
    from ..serve.app import serve
    from ..trainer.world import pick_device

    device = pick_device(cfg.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    cfg = dataclasses.replace(cfg, device=str(device))
    service = TinkerService(cfg)
    rank = service.ranks.rank
    try:
        if rank == 0:
            split = (", the base sharded over them (FSDP)" if cfg.fsdp else "") + (f", stages over pp={cfg.pp}" if cfg.pp > 1 else "") + (f", rows over cp={cfg.cp}" if cfg.cp > 1 else "") \
                + (f", layers over tp={cfg.tp}" if cfg.tp > 1 else "") + _tp_extras(cfg) \
                + (f", experts over ep={cfg.ep}" if cfg.ep > 1 else "")
            print(f"trillora serve: data parallel over {service.ranks.dp_size} ranks{split}", flush=True)
            serve(cfg, service=service)
        else:
            service.follow()
    finally:
        if rank == 0:
            service.stop()
        # the meshes and FSDP states hold process groups in reference cycles: freed now, while the
        # interpreter is whole (freed at exit, gloo's threads can abort the process)
        del service
        gc.collect()
        dist.destroy_process_group()
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from ..plots import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ..lora.config import EXPERT_RANK_RULES
    from ..models.params import SHIPPED_CONFIGS
    from . import info, plan, traces

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
        p.add_argument("--trust-remote-code", action="store_true",
                           help="run the tokenizer's own Python code (Kimi K2's tiktoken tokenizer); off by default")
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

    p = sub.add_parser("serve", help="OpenAI-compatible completion server over the built-in engine; with --tinker "
                                     "the Tinker training API (the tinker SDK and tinker-cookbook as clients)")
    p.add_argument("model", help="Hugging Face checkpoint folder, or tiny-moe")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=None, help="require the key on every route but /health: "
                   "'Authorization: Bearer KEY' or 'X-API-Key: KEY'; repeat for several keys (each key's traces are its own)")
    p.add_argument("--record", default=None, metavar="STORE", help="record every OpenAI completion (token ids, logprobs, "
                   "revision, trace id) in this trace store: a SQLite file or a postgresql:// URL; /v1/feedback scores traces")
    p.add_argument("--learn", default=None, metavar="CONFIG", help="with --record: train the served policy on its rewarded "
                   "traffic (a train TOML: [lora], [optim], [algorithm], [learn]) and serve each new revision as it is made")
    p.add_argument("--tinker", action="store_true", help="serve the Tinker REST API: LoRA training clients on one base")
    p.add_argument("--state-dir", default="tinker-state",
                   help="--tinker: where saved states and sampler weights go (default: tinker-state in the working folder)")
    p.add_argument("--max-clients", type=int, default=16, help="--tinker: training clients held at once")
    p.add_argument("--max-samplers", type=int, default=256, help="--tinker: sampling sessions held at once")
    p.add_argument("--max-sessions", type=int, default=256, help="--tinker: sessions held at once (one not heard "
                                                                 "from for 5 minutes is ended and freed)")
    p.add_argument("--idle-seconds", type=float, default=60.0, help="a connection may wait this long before a request")
    p.add_argument("--header-seconds", type=float, default=10.0, help="from a request's first byte to its headers' end")
    p.add_argument("--body-seconds", type=float, default=60.0, help="for a request's whole body")
    p.add_argument("--max-call-tokens", type=int, default=65536, help="tokens one call may hold: a forward_backward's "
                                                                      "datums, or n × (prompt + max_tokens) of a sample")
    p.add_argument("--device", default="cpu", help="--tinker: where the base and the adapters live (cpu, cuda)")
    p.add_argument("--tp", type=int, default=1, help="--tinker under torchrun: split attention and dense MLP layers "
                                                     "(and the clients' adapters on them) over groups of TP ranks")
    p.add_argument("--ep", type=int, default=1, help="--tinker under torchrun: shard the routed experts (and the "
                                                     "clients' expert adapters) over groups of EP ranks")
    p.add_argument("--pp", type=int, default=1, help="--tinker under torchrun: split the decoder layers into PP "
                                                     "pipeline stages, one per rank of a pipeline group")
    p.add_argument("--cp", type=int, default=1, help="--tinker under torchrun: split each row of a training pass "
                                                     "over CP ranks (context parallelism, for long traces)")
    p.add_argument("--fsdp", action="store_true", help="--tinker under torchrun: shard the frozen base over the "
                                                         "data-parallel ranks (FSDP2), gathered layer by layer")
    p.add_argument("--sp", action="store_true", help="--tinker --tp: sequence parallelism (norms and the residual "
                                                     "stream split over the sequence)")
    p.add_argument("--vocab-parallel", action="store_true", help="--tinker --tp: split the head over the vocabulary; "
                                                                 "losses never hold the full logits")
    p.add_argument("--pp-microbatches", type=int, default=1, help="--tinker --pp: a pass's rows in this many chunks "
                                                                  "in flight, so the stages overlap")
    p.add_argument("--expert-rank-rule", default="same", choices=EXPERT_RANK_RULES,
                   help="--tinker: each client's routed-expert adapters at its rank, or at rank // top_k")
    p.add_argument("--activation-checkpoint-every", type=int, default=0,
                   help="--tinker: recompute every k-th decoder layer in backward instead of keeping its activations")
    p.add_argument("--max-fused", type=int, default=16,
                   help="--tinker: waiting requests (of several clients) sharing one pass through the base; 1: never")
    p.add_argument("--adapter-root", default=None, help="folder adapters may be loaded from (load_lora_adapter)")
    p.add_argument("--adapter-memory-mib", type=float, default=None,
                   help="memory the loaded adapters may hold together (default: half of what is free once the base is loaded)")
    p.add_argument("--precision", default="fp32", choices=[c for c in typing.get_args(Precision) if c not in ("auto", "policy")])
    p.add_argument("--max-connections", type=int, default=512, help="connections open at once; the next is answered 503")
    p.add_argument("--trust-remote-code", action="store_true",
                       help="run the tokenizer's own Python code (Kimi K2's tiktoken tokenizer); off by default")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("traces", help="list, export (JSONL, Parquet) or delete what serve --record recorded")
    traces.add_arguments(p)
    p.set_defaults(func=traces.cmd_traces)

    p = sub.add_parser("plot", help="write the PNG plots of a run folder")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TrilloraError as e:
        if e.__cause__ is not None and getattr(e, "show_cause", False):  # the user's code: show where it failed
            import traceback

            traceback.print_exception(e.__cause__, file=sys.stderr)
        print(f"trillora {args.command}: error: {e}", file=sys.stderr)
        return 2
