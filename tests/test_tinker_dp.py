"""`torchrun --nproc-per-node 2 -m trillora serve MODEL --tinker` (gloo): the real SDK trains a client
on two data-parallel ranks and gets the losses, logprobs and adapter one process gives."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from engine_helpers import free_port, tinker_server  # noqa: E402

MODEL, KEY = "tiny-moe-chat", "tml-test-key"


def wait_healthy(port: int, proc: subprocess.Popen) -> None:
    for _ in range(600):
        assert proc.poll() is None, proc.stdout.read()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/api/v1/healthz")
            if json.loads(conn.getresponse().read()) == {"status": "ok"}:
                return
        except (ConnectionRefusedError, OSError):
            time.sleep(0.2)
    pytest.fail("the data-parallel server did not come up")


def train(port: int, state_dir: Path, tokenizer) -> dict:
    """Three datums (split 1 + 2 over two ranks), three steps with a refused optim_step between, then
    a saved state and a sample from it."""
    sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=KEY)
    try:
        tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result()
        data = []
        for text, prompt_len in (("123+456=579", 8), ("12+7=19", 5), ("reverse abc: cba", 12)):
            tokens = tokenizer.encode(text, add_special_tokens=False)
            adv = [0.0] * (prompt_len - 1) + [1.0 - 0.5 * len(data)] * (len(tokens) - prompt_len)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                    loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [-1.0] * (len(tokens) - 1),
                                                    "advantages": adv}))
        losses, logprobs = [], []
        for step in range(3):
            out = tc.forward_backward(data, "importance_sampling").result()
            losses.append(out.metrics["loss:sum"])
            logprobs.append([o["logprobs"].tolist() for o in out.loss_fn_outputs])
            if step == 1:
                with pytest.raises(Exception, match="beta1"):
                    tc.optim_step(types.AdamParams(learning_rate=1e-2, beta1=2.0)).result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = tc.save_state("after-3").result().path
        sampler = tc.save_weights_and_get_sampling_client().result()
        prompt = tokenizer.encode("12+7=", add_special_tokens=False)
        res = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2,
                             sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=1)).result()
    finally:
        sc.close("success").result()
    folder = state_dir / path.split("://", 1)[1].split("/")[0].replace(":", "_") / "weights" / "after-3"
    return {"losses": losses, "logprobs": logprobs, "state": load_file(str(folder / "adapter.safetensors")),
            "samples": res.sequences}


def test_two_data_parallel_ranks_train_as_one_process(tmp_path):
    gen = tinker_server(tmp_path / "one", KEY)
    one = next(gen)
    try:
        alone = train(one.cfg.port, tmp_path / "one", one.service.tokenizer)
    finally:
        next(gen, None)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                             str(free_port()), "-m", "trillora", "serve", MODEL, "--tinker", "--port", str(port),
                             "--api-key", KEY, "--state-dir", str(tmp_path / "dp")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(port, proc)
        dp = train(port, tmp_path / "dp", one.service.tokenizer)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
    assert "data parallel over 2 ranks" in out
    np.testing.assert_allclose(dp["losses"], alone["losses"], rtol=1e-5)
    for a, b in zip(dp["logprobs"], alone["logprobs"], strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5)
    assert alone["losses"][2] != alone["losses"][0]  # the steps moved the adapter
    assert set(dp["state"]) == set(alone["state"])
    for k, t in alone["state"].items():
        if k == "rng.torch":  # the server process's own random state, not the client's
            continue
        torch.testing.assert_close(dp["state"][k], t, atol=1e-5, rtol=1e-4)
    assert len(dp["samples"]) == 2 and all(len(s.tokens) == len(s.logprobs) >= 1 for s in dp["samples"])
