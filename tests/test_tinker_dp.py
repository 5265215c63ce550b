"""`torchrun --nproc-per-node N -m trillora serve MODEL --tinker [--tp T --ep K --pp P --cp C]` (gloo): the
real SDK trains a client on data-parallel ranks, or on ranks that split the base (experts, layers over
tp, pipeline stages, each row's positions), and gets the losses, logprobs, adapter, resumed steps and samples one
process gives."""

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
from engine_helpers import free_port, tinker_server  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tinker import types  # noqa: E402

pytestmark = pytest.mark.slow  # torchrun services

MODEL, KEY = "tiny-moe-chat", "tml-test-key"


def wait_healthy(port: int, proc: subprocess.Popen) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            out = proc.stdout.read()
            if "Address already in use" in out:  # free_port() reserves nothing: another process took it first
                raise PortTaken(out)
            pytest.fail(out)
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
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [-1.0] * (len(tokens) - 1),
                        "advantages": adv,
                    },
                )
            )
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
        res = sampler.sample(
            types.ModelInput.from_ints(prompt),
            num_samples=2,
            sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=1),
        ).result()
    finally:
        sc.close("success").result()
    folder = state_dir / path.split("://", 1)[1].split("/")[0].replace(":", "_") / "weights" / "after-3"
    return {
        "losses": losses,
        "logprobs": logprobs,
        "state": load_file(str(folder / "adapter.safetensors")),
        "samples": res.sequences,
    }


def more(port: int, state_dir: Path, tokenizer) -> dict:
    """What an expert-parallel service must also get right: a clipped step (the norm spans every
    rank's experts), a call of one datum (one rank runs none), a resumed client, and samplers from
    a named revision and from the base (their prompt logprobs pass through every rank's experts)."""
    sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=KEY)
    try:
        tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=2).result()
        tokens = tokenizer.encode("987+12=999", add_special_tokens=False)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        losses, norms = [], []
        for _ in range(2):
            losses.append(tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
            norms.append(
                tc.optim_step(types.AdamParams(learning_rate=2e-2, grad_clip_norm=0.05))
                .result()
                .metrics["grad_norm:mean"]
            )
        path = tc.save_state("two").result().path
        resumed = sc.create_training_client_from_state_with_optimizer(path).result()
        resumed.forward_backward([datum], "cross_entropy").result()
        resumed.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        losses.append(resumed.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
        prompt = types.ModelInput.from_ints(tokenizer.encode("98+12=", add_special_tokens=False))
        named = sc.create_sampling_client(model_path=resumed.save_weights_for_sampler("named").result().path).result()
        base = sc.create_sampling_client(base_model=MODEL).result()
        greedy = (
            named.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=5, temperature=0.0))
            .result()
            .sequences[0]
        )
        return {
            "losses": losses,
            "norms": norms,
            "named": named.compute_logprobs(prompt).result()[1:],
            "base": base.compute_logprobs(prompt).result()[1:],
            "greedy": greedy.tokens,
            "greedy_lp": greedy.logprobs,
        }
    finally:
        sc.close("success").result()


class PortTaken(Exception):
    pass


def launch_healthy(state_dir: Path, *extra: str, ranks: int = 2) -> tuple[int, subprocess.Popen]:
    for attempt in range(3):
        port = free_port()
        proc = launch(port, state_dir, *extra, ranks=ranks)
        try:
            wait_healthy(port, proc)
            return port, proc
        except PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def launch(port: int, state_dir: Path, *extra: str, ranks: int = 2) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(ranks),
            "--master-port",
            str(free_port()),
            "-m",
            "trillora",
            "serve",
            MODEL,
            "--tinker",
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--state-dir",
            str(state_dir),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> dict:
    """Both scenarios on one process: what every layout must give."""
    folder = tmp_path_factory.mktemp("one")
    gen = tinker_server(folder, KEY)
    one = next(gen)
    try:
        return {
            "train": train(one.cfg.port, folder, one.service.tokenizer),
            "more": more(one.cfg.port, folder, one.service.tokenizer),
            "tokenizer": one.service.tokenizer,
        }
    finally:
        next(gen, None)


LAYOUTS = {
    # the defaults (ParallelDims'): the base sharded over the data-parallel ranks
    "dp": (2, [], "data parallel over 2 ranks, the base sharded over them (FSDP)"),
    "ep": (2, ["--ep", "2", "--no-fsdp"], "data parallel over 2 ranks, experts over ep=2"),
    "tp": (2, ["--tp", "2"], "data parallel over 1 ranks, layers over tp=2"),
    # recomputing layers in backward runs their all-reduces and all-to-alls again, in order on every rank
    "tp-ep": (
        4,
        ["--tp", "2", "--ep", "2", "--activation-checkpoint-every", "1", "--no-fsdp"],
        "data parallel over 2 ranks, layers over tp=2, experts over ep=2",
    ),
    # 3 datums a call: two chunks in flight through the stages
    "pp": (2, ["--pp", "2", "--pp-microbatches", "2"], "data parallel over 1 ranks, stages over pp=2"),
    # a 1-datum call leaves dp rank 1's two stages one filler token to pass down and back
    "pp-ep": (
        4,
        ["--pp", "2", "--ep", "2", "--no-fsdp"],
        "data parallel over 2 ranks, stages over pp=2, experts over ep=2",
    ),
    "pp-tp": (
        4,
        ["--pp", "2", "--tp", "2", "--activation-checkpoint-every", "1"],
        "data parallel over 1 ranks, stages over pp=2, layers over tp=2",
    ),
    # each row's positions split over 2 ranks in training; sampling decodes whole rows on both
    "cp": (2, ["--cp", "2", "--activation-checkpoint-every", "1"], "data parallel over 1 ranks, rows over cp=2"),
    # the dense layers sharded over both ranks; each expert shard has one owner, left out of FSDP
    "fsdp-ep": (
        2,
        ["--fsdp", "--ep", "2"],
        "data parallel over 2 ranks, the base sharded over them (FSDP), experts over ep=2",
    ),
    "tp-sp-vocab": (
        2,
        ["--tp", "2", "--sp", "--vocab-parallel"],
        "data parallel over 1 ranks, layers over tp=2 (sequence-parallel norms, the head over the vocabulary)",
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_train_as_one_process(tmp_path, alone, layout):
    ranks, flags, banner = LAYOUTS[layout]
    port, proc = launch_healthy(tmp_path / layout, *flags, ranks=ranks)
    try:
        got = train(port, tmp_path / layout, alone["tokenizer"])
        extra = more(port, tmp_path / layout, alone["tokenizer"])
        if "--pp" in flags:  # the head alone lives on the last stage: the others would hold no adapter
            sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=KEY)
            with pytest.raises(Exception, match="trains only the unembedding, which lives on the last of --pp 2"):
                sc.create_lora_training_client(base_model=MODEL, rank=4, train_mlp=False, train_attn=False).result()
            sc.close("success").result()
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
    assert banner in out
    want = alone["more"]
    np.testing.assert_allclose(extra["losses"], want["losses"], rtol=1e-5)
    np.testing.assert_allclose(extra["norms"], want["norms"], rtol=1e-5)
    assert want["norms"][0] > 0.05  # the clip acted, so a norm missing the other rank's experts would show
    np.testing.assert_allclose(extra["named"], want["named"], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(extra["base"], want["base"], atol=1e-5, rtol=1e-5)
    assert extra["named"] != pytest.approx(extra["base"], abs=1e-3)  # the revision is not the base
    assert extra["greedy"] == want["greedy"]
    np.testing.assert_allclose(extra["greedy_lp"], want["greedy_lp"], atol=5e-5)  # decoded with a KV cache
    alone = alone["train"]
    np.testing.assert_allclose(got["losses"], alone["losses"], rtol=1e-5)
    for a, b in zip(got["logprobs"], alone["logprobs"], strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)  # tp all-reduces reorder fp32 sums
    assert alone["losses"][2] != alone["losses"][0]  # the steps moved the adapter
    assert set(got["state"]) == set(alone["state"])
    for k, t in alone["state"].items():
        if k == "rng.torch":  # the server process's own random state, not the client's
            continue
        # AdamW divides by the gradient's own size, so where a gradient is ~0 the fp32 reorderings of tp's
        # all-reduces move a step by a little more; a wrong part or a missing sum moves it by the lr (1e-2)
        torch.testing.assert_close(got["state"][k], t, atol=5e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    assert len(got["samples"]) == 2 and all(len(s.tokens) == len(s.logprobs) >= 1 for s in got["samples"])


def test_an_expert_layout_that_cannot_work_is_named(tmp_path):
    alone = subprocess.run(
        [sys.executable, "-m", "trillora", "serve", MODEL, "--tinker", "--ep", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert alone.returncode != 0 and "a sharded base needs several ranks" in alone.stderr
    staged = subprocess.run(
        [sys.executable, "-m", "trillora", "serve", MODEL, "--tinker", "--pp", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert staged.returncode != 0 and "--pp 3 --cp 1: a sharded base needs several ranks" in staged.stderr
    split = subprocess.run(
        [sys.executable, "-m", "trillora", "serve", MODEL, "--tinker", "--vocab-parallel"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        split.returncode != 0
        and "vocab_parallel splits over the tensor-parallel ranks; it needs tp >= 2" in split.stderr
    )
    proc = launch(free_port(), tmp_path, "--ep", "4")
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0
    assert "--tp 1 --ep 4 --pp 1 --cp 1 on 2 ranks: parallel.ep=4 must divide parallel.dp=2" in out
