"""What `train`, `eval`, `generate`, `serve` and `plot` run: thin functions over the library."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import ConfigError


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
    return SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, stop_token_ids=stop
    )


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
    shown = {k: getattr(args, k) for k in ("problems", "samples", "temperature")}
    print(json.dumps({"task": args.task, "accuracy": acc, **shown}))
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
    if "exit_code" in summary:  # stopped by a signal after a checkpoint: 130 for Ctrl-C, 143 for SIGTERM
        return summary["exit_code"]
    if summary:  # under torchrun only rank 0 reports
        print(json.dumps({k: v for k, v in summary.items() if k != "adapter"}, indent=2))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from ..policy.world import launched
    from ..serve.app import Server
    from ..serve.config import ServeConfig
    from .flags import config_of

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"trillora serve: warning: listening on {args.host} without --api-key", file=sys.stderr)
    cfg = config_of(ServeConfig, args)
    if args.learn and not args.record:
        raise ConfigError("--learn trains on recorded traffic: give --record STORE too")
    if launched():
        if args.learn:  # refused before the process group starts, on every rank alike
            from ..trainer.learner import check_parallel

            check_parallel(_learn_config(args.learn))
        return _serve_parallel(cfg, args.learn)
    if _sharded(cfg):
        p = cfg.parallel
        raise SystemExit(
            f"trillora serve --tp {p.tp} --ep {p.ep} --pp {p.pp} --cp {p.cp}: a sharded base needs several "
            f"ranks; launch with torchrun --nproc-per-node N (N a multiple of {p.tp * p.pp * p.cp * p.ep})"
        )
    server = Server(cfg)
    if args.learn:
        start_learning(server, args.learn)
    server.run()
    return 0


def start_learning(server, config_path: str, poll_seconds: float = 1.0):
    """`--learn CONFIG`: a learner on the server's base, publishing revisions as its traffic is rewarded."""
    from ..serve.revisions import Revisions

    train = _learn_config(config_path)
    revisions = Revisions(server.service, train.learn.publish_as or server.cfg.model, train.learn.keep)
    server.app.include_router(revisions.router)
    operator = server.cfg.operator()
    owners = {operator} if operator is not None and train.learn.from_keys == "operator" else None
    learner = _learner(server.service, train, server.openai.recorder.store, revisions.publish, owners)
    revisions.attach(learner, server.worker, poll_seconds)
    server.revisions = revisions
    return revisions


def follow_learning(service, config_path: str):
    """The other ranks of a learning server: the same learner on their part of the base, publishing
    each revision into their registry as rank 0 does (its rounds reach them as commands)."""
    from ..policy.adapters import Revision

    train = _learn_config(config_path)
    name, keep = train.learn.publish_as or service.cfg.model, train.learn.keep
    return _learner(service, train, None, lambda k, t, c: service.registry.publish(name, k, Revision(c, t), keep))


def _learn_config(config_path: str):
    from ..config import load_config
    from ..policy.adapters import SLOT_ROLES

    train = load_config(config_path)
    if train.lora.patterns or train.lora.exclude or not set(train.lora.targets) <= set(SLOT_ROLES):
        raise ConfigError(
            f"{config_path}: [lora] of a learning server adapts whole roles of {list(SLOT_ROLES)} "
            f"(no patterns or exclude); got targets={list(train.lora.targets)}"
        )
    return train


def _learner(service, train, store, publish, owners=None):
    from pathlib import Path

    from ..trainer.learner import Learner

    folder = Path(service.cfg.state_dir) / "learner"
    service.learner = Learner(
        service.base, store, train, publish, folder, service.device, service.tokenizer, owners, service.ranks
    )
    return service.learner


def _sharded(cfg) -> bool:
    """A layout one process cannot hold (`fsdp` alone shards over data-parallel ranks: one process has one)."""
    p = cfg.parallel
    return p.ep > 1 or p.tp > 1 or p.pp > 1 or p.cp > 1


def _serve_parallel(cfg, learn: str | None = None) -> int:
    """Under torchrun: every rank holds the base (split with --tp / --ep / --pp) and the clients' adapters;
    rank 0 serves HTTP (`policy.world`); with `learn`, every rank runs the learner's rounds."""
    import dataclasses
    import gc

    import torch.distributed as dist

    from ..policy.world import pick_device
    from ..serve.app import Server
    from ..serve.tinker.service import TinkerService

    device = pick_device(cfg.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    cfg = dataclasses.replace(cfg, device=str(device))
    service = TinkerService(cfg)
    rank = service.ranks.rank
    try:
        if rank == 0:
            d = service.ranks.dims
            extras = [
                w
                for w, on in (("sequence-parallel norms", d.sp), ("the head over the vocabulary", d.vocab_parallel))
                if on
            ]
            split = (
                (", the base sharded over them (FSDP)" if d.fsdp and d.dp > 1 else "")
                + (f", stages over pp={d.pp}" if d.pp > 1 else "")
                + (f", rows over cp={d.cp}" if d.cp > 1 else "")
                + (f", layers over tp={d.tp}" if d.tp > 1 else "")
                + (f" ({', '.join(extras)})" if extras else "")
                + (f", experts over ep={d.ep}" if d.ep > 1 else "")
            )
            print(f"trillora serve: data parallel over {service.ranks.dims.dp} ranks{split}", flush=True)
            server = Server(cfg, service)
            if learn:
                start_learning(server, learn)
            server.run()
        else:
            if learn:
                follow_learning(service, learn)
            service.follow()
    finally:
        if rank == 0:
            service.stop()
        # the meshes and FSDP states hold process groups in reference cycles: freed now, for a caller of
        # main() that goes on (`cli.entry` then leaves the rank without teardown: `policy.world.leave_rank`)
        del service
        gc.collect()
        dist.destroy_process_group()
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from ..plots import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0
