"""Shared by the engine tests: loopback ports, server start-up, trainer-side logprobs."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request

import torch

from trillora.serve.config import ServeConfig
from trillora.trainer.batch import build_batch
from trillora.policy.logprobs import token_logprobs


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


def trainer_logprobs(model, completions, temperature: float = 1.0):
    """(trainer's logprobs, engine's logprobs) of every completion token, flattened."""
    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], [c.logprobs for c in completions])
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch.input_ids, temperature)
    m = batch.completion_mask.bool()
    return logp[m], batch.rollout_logprobs[m]


def tinker_server(state_dir, api_key: str, **cfg):
    """`trillora serve tiny-moe-chat --tinker` on a free loopback port in a thread: yields the
    Server (its `cfg.port` set), stopped afterwards."""
    yield from running_server(ServeConfig(model="tiny-moe-chat", tinker=True, port=0, api_key=api_key,
                                          state_dir=str(state_dir), poll_seconds=2.0, **cfg))


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
