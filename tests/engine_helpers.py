"""Shared by the engine tests: loopback ports, server start-up, trainer-side logprobs."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request

import torch

from trillora.trainer.batch import build_batch
from trillora.trainer.logprobs import token_logprobs


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
    TinkerServer (its `cfg.port` set), shut down afterwards."""
    import threading

    from trillora.serve.tinker_http import TinkerServer, serve_tinker
    from trillora.serve.tinker_service import TinkerConfig

    config = TinkerConfig(model="tiny-moe-chat", port=0, api_key=api_key, state_dir=str(state_dir), poll_seconds=2.0, **cfg)
    server = TinkerServer(config)
    ready = threading.Event()
    threading.Thread(target=serve_tinker, args=(config, ready, server), daemon=True).start()
    ready.wait(60)
    yield server
    server.httpd.shutdown()
