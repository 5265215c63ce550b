"""Shared by the engine tests: loopback ports, server start-up, trainer-side logprobs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import torch

from trillora.envs.trajectory import Sample
from trillora.policy.logprobs import token_logprobs
from trillora.serve.config import ServeConfig
from trillora.trainer.batch import TokenBatch, batch_from_samples, with_routes


def build_batch(
    prompts: list[list[int]],
    completions: list[list[int]],
    logprobs: list[list[float]],
    pad_id: int = 0,
    device: torch.device | str = "cpu",
    routes: list[torch.Tensor] | None = None,
) -> TokenBatch:
    """Single-turn rows (prompt, completion, its logprobs). `routes`: each completion's recorded routing
    [len(prompt) + len(completion) - 1, L, K], or None."""
    batch = batch_from_samples(
        [Sample.single_turn(p, c, lp) for p, c, lp in zip(prompts, completions, logprobs, strict=True)], pad_id, device
    )
    return with_routes(batch, routes) if routes is not None else batch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(proc: subprocess.Popen, url: str, timeout: float) -> str | None:
    """None once `url`/health answers; the process's last output if it exited; a message on time-out."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return None
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None:
                return proc.stdout.read().decode(errors="replace")[-3000:] if proc.stdout else "exited"
            time.sleep(0.5)
    proc.kill()
    return f"did not answer /health within {timeout:.0f} s"


def post_json(
    url: str, path: str, body: dict | None, key: str | None = None, raw: bytes | None = None
) -> tuple[int, dict]:
    """(status, JSON body) of a POST, errors included (a 4xx is an answer here, not an exception)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(
        url + path, data=raw if raw is not None else json.dumps(body).encode(), headers=headers
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def serve_process(argv: list[str], cwd=None, timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """`trillora serve ...` (argv after `trillora`) in its own process on a free loopback port
    (appended: the last --port wins), once it answers /health: (process, base url)."""
    port = free_port()
    proc = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "trillora"), *argv, "--port", str(port)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    failed = wait_for_health(proc, url, timeout)
    assert failed is None, failed
    return proc, url


def trainer_logprobs(model, completions, temperature: float = 1.0):
    """(trainer's logprobs, engine's logprobs) of every completion token, flattened."""
    batch = build_batch(
        [c.prompt_ids for c in completions], [c.token_ids for c in completions], [c.logprobs for c in completions]
    )
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch.input_ids, temperature)
    m = batch.completion_mask.bool()
    return logp[m], batch.rollout_logprobs[m]


def tinker_server(state_dir, api_key: str, **cfg):
    """`trillora serve tiny-moe-chat --tinker` on a free loopback port in a thread: yields the
    Server (its `cfg.port` set), stopped afterwards."""
    yield from running_server(
        ServeConfig(
            model="tiny-moe-chat",
            tinker=True,
            port=0,
            api_key=api_key,
            state_dir=str(state_dir),
            poll_seconds=2.0,
            **cfg,
        )
    )


def running_server(config):
    """A `trillora serve` Server for `config` in a thread: yielded once it listens, stopped afterwards."""
    import threading

    from trillora.serve.app import Server

    server = Server(config)
    ready = threading.Event()
    thread = threading.Thread(target=server.run, args=(ready,), daemon=True)
    thread.start()
    ready.wait(60)
    yield server
    server.stop()
    thread.join(30)


def serve_layout(**flags):
    """`ServeConfig.parallel` from `serve`'s flags, with the defaults the sharded-service tests were
    written for: the base replicated over the data-parallel ranks (fsdp off unless asked) and a
    pass's rows in one chunk under pp."""
    from trillora.parallel import ParallelDims

    return ParallelDims(**{"dp": 0, "fsdp": False, "pp_microbatches": 1, **flags})


def serve_config(**flags):
    """A ServeConfig from `serve`'s flags as keywords: the layout's into `parallel` (`serve_layout`)."""
    import dataclasses

    from trillora.parallel import ParallelDims
    from trillora.serve.config import ServeConfig

    layout = {f.name for f in dataclasses.fields(ParallelDims)}
    return ServeConfig(
        parallel=serve_layout(**{k: v for k, v in flags.items() if k in layout}),
        **{k: v for k, v in flags.items() if k not in layout},
    )
