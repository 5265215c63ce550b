"""`trillora serve --tinker` with the real `tinker` SDK as the client, on the shipped tiny chat MoE."""

from __future__ import annotations

import http.client
import json
import threading

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from engine_helpers import tinker_server  # noqa: E402
from tinker import types  # noqa: E402

MODEL = "tiny-moe-chat"
KEY = "tml-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from tinker_server(tmp_path_factory.mktemp("state"), KEY, max_body_bytes=1 << 20)


@pytest.fixture(scope="module")
def service_client(server):
    sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{server.cfg.port}", api_key=KEY)
    yield sc
    sc.close("success").result()  # stops its heartbeat thread, which would hold ephemeral ports for the rest of the run


def encode(server, text: str) -> list[int]:
    return server.service.tokenizer.encode(text, add_special_tokens=False)


def sft_datum(tokens: list[int], prompt_len: int) -> types.Datum:
    weights = [0.0] * (prompt_len - 1) + [1.0] * (len(tokens) - prompt_len)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def adapter_of(server, tc) -> dict[str, torch.Tensor]:
    return {k: t.clone() for k, t in server.service.client(tc.model_id).adapter.tensors().items()}


def test_supervised_steps_lower_the_loss_and_the_sampler_agrees_with_forward(server, service_client):
    tc = service_client.create_lora_training_client(base_model=MODEL, rank=4).result()
    info = tc.get_info()
    assert info.model_data.model_name == MODEL and info.lora_rank == 4
    tokens = encode(server, "123+456=579")
    data = [sft_datum(tokens, 8)]
    losses = []
    for _ in range(4):
        out = tc.forward_backward(data, "cross_entropy").result()
        losses.append(out.metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    assert losses[-1] < losses[0]
    assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == len(tokens) - 1
    # the loss is -Σ w·logp of the returned logprobs
    lp = np.array(out.loss_fn_outputs[0]["logprobs"].tolist())
    w = np.array(data[0].loss_fn_inputs["weights"].tolist())
    assert out.metrics["loss:sum"] == pytest.approx(-(w * lp).sum(), rel=1e-5)

    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = encode(server, "123+456=")
    res = sampler.sample(
        types.ModelInput.from_ints(prompt),
        num_samples=3,
        sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=3),
    ).result()
    assert len(res.sequences) == 3
    for seq in res.sequences:
        assert len(seq.tokens) == len(seq.logprobs) >= 1 and seq.stop_reason in ("stop", "length")
        # forward on prompt + sample, same adapter, fp32: the sampler's logprobs to 1e-4
        full = prompt + seq.tokens
        fwd = tc.forward(
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={"target_tokens": full[1:]}
                )
            ],
            "cross_entropy",
        ).result()
        got = fwd.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :]
        np.testing.assert_allclose(got, seq.logprobs, atol=1e-4)
    # a forward pass leaves no gradient behind: the next step equals one without it
    assert all(p.grad is None for p in server.service.client(tc.model_id).adapter.params.values())


def test_rl_losses_return_logprobs_and_their_documented_sums(server, service_client):
    tc = service_client.create_lora_training_client(base_model=MODEL, rank=2, train_unembed=False).result()
    tokens = encode(server, "12+34=46")
    n = len(tokens) - 1
    sampling = np.full(n, -1.0, dtype=np.float32)
    adv = np.linspace(-1, 1, n).astype(np.float32)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": sampling, "advantages": adv},
    )
    lp = np.array(tc.forward([datum], "importance_sampling").result().loss_fn_outputs[0]["logprobs"].tolist())
    r = np.exp(lp - sampling)
    want = {
        "importance_sampling": -(r * adv).sum(),
        "ppo": -np.minimum(r * adv, np.clip(r, 0.8, 1.2) * adv).sum(),
        "cispo": -(np.clip(r, 0.8, 1.2) * lp * adv).sum(),
        "dro": -(lp * adv - 0.5 * 0.1 * (lp - sampling) ** 2).sum(),
    }
    mask = (np.arange(n) >= n // 2).astype(np.float32)  # gspo: the sequence ratio over the second half
    s = np.exp((lp - sampling)[mask > 0].mean())
    want["gspo"] = -np.minimum(s * adv, np.clip(s, 0.8, 1.2) * adv).sum()
    for name, value in want.items():
        inputs = {**datum.loss_fn_inputs, "sequence_ratio_mask": mask} if name == "gspo" else datum.loss_fn_inputs
        out = tc.forward_backward(
            [types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs)],
            name,
            loss_fn_config={"beta": 0.1} if name == "dro" else None,
        ).result()
        assert out.metrics["loss:sum"] == pytest.approx(value, rel=1e-4, abs=1e-5), name
    step = tc.optim_step(types.AdamParams(learning_rate=1e-3, grad_clip_norm=1.0)).result()
    assert step.metrics["grad_norm:mean"] > 0


def test_resume_from_saved_state_continues_bit_for_bit(server, service_client):
    tc = service_client.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result()
    data = [sft_datum(encode(server, "7+8=15"), 4), sft_datum(encode(server, "99+1=100"), 5)]

    def step(client):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2, weight_decay=0.01)).result()

    step(tc)
    path = tc.save_state("after-1").result().path
    assert path == f"tinker://{tc.model_id}/weights/after-1"
    step(tc)
    step(tc)
    resumed = service_client.create_training_client_from_state_with_optimizer(path).result()
    step(resumed)
    step(resumed)
    a, b = adapter_of(server, tc), adapter_of(server, resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fresh = service_client.create_training_client_from_state(path).result()  # weights only: Adam starts over
    step(fresh)
    step(fresh)
    c = adapter_of(server, fresh)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_two_clients_at_once_train_as_each_alone(server, service_client):
    """Each client's adapter and optimizer are its own although both run on one resident base."""
    jobs = {"a": sft_datum(encode(server, "1+2=3"), 4), "b": sft_datum(encode(server, "50+50=100"), 6)}

    def train(name, out):
        tc = service_client.create_lora_training_client(base_model=MODEL, rank=3, seed=1).result()
        for _ in range(3):
            tc.forward_backward([jobs[name]], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        out[name] = adapter_of(server, tc)

    together: dict = {}
    threads = [threading.Thread(target=train, args=(k, together)) for k in jobs]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for name in jobs:
        alone: dict = {}
        train(name, alone)
        for k in alone[name]:  # passes shared by both clients sum in another order: fp32 rounding, which
            # AdamW's division by sqrt(v) magnifies; still 100x below one step's size (lr 1e-2)
            assert (together[name][k] - alone[name][k]).abs().max() < 1e-4, (name, k)
    assert any(not torch.equal(together["a"][k], together["b"][k]) for k in together["a"])  # other data, other adapter


def raw(server, method: str, path: str, body: bytes = b"", headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", server.cfg.port, timeout=30)
    conn.request(
        method, path, body=body, headers={"X-API-Key": KEY, "Content-Type": "application/json", **(headers or {})}
    )
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def post(server, path: str, payload: dict, **kw):
    return raw(server, "POST", path, json.dumps(payload).encode(), **kw)


def test_bad_requests_get_4xx_with_a_message(server, service_client):
    status, body = post(server, "/api/v1/create_session", {"tags": [], "type": "create_session"})
    sid = json.loads(body)["session_id"]
    cases = [
        (
            post(
                server,
                "/api/v1/create_model",
                {"session_id": sid, "model_seq_id": 0, "base_model": "Qwen/Qwen3-8B", "lora_config": {"rank": 4}},
            ),
            404,
            "unknown base_model 'Qwen/Qwen3-8B'",
        ),
        (
            post(
                server,
                "/api/v1/create_model",
                {"session_id": sid, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 0}},
            ),
            400,
            "lora_config.rank=0",
        ),
        (
            post(server, "/api/v1/optim_step", {"model_id": "nobody:train:0", "seq_id": 1, "adam_params": {}}),
            404,
            "unknown model_id 'nobody:train:0'",
        ),
        (
            raw(
                server, "POST", "/api/v1/forward_backward", b"\x1a\x05\x0a", {"Content-Type": "application/x-protobuf"}
            ),
            400,
            "forward_backward body",
        ),
        (raw(server, "POST", "/api/v1/create_session", b"{not json"), 400, "invalid JSON"),
        (raw(server, "POST", "/api/v1/create_session", b"x" * (2 << 20)), 413, "at most 1048576"),
        (raw(server, "POST", "/api/v1/create_session", b"{}", {"X-API-Key": "tml-wrong"}), 401, "API key"),
        (raw(server, "GET", "/api/v1/nothing"), 404, "no route GET /api/v1/nothing"),
    ]
    cases += [  # paths: names become folders under --state-dir, nothing outside it is read or written
        (post(server, "/api/v1/weights_info", {"tinker_path": "tinker://../weights/x"}), 400, "model id '..'"),
        (
            post(server, "/api/v1/weights_info", {"tinker_path": "tinker://a:train:0/weights/.."}),
            400,
            "checkpoint name '..'",
        ),
        (
            post(server, "/api/v1/weights_info", {"tinker_path": "tinker://a/../../etc/weights/x"}),
            400,
            "is not tinker://",
        ),
        (
            post(server, "/api/v1/create_sampling_session", {"session_id": sid, "model_path": "/etc/passwd"}),
            400,
            "is not tinker://",
        ),
    ]
    for (status, body), want_status, message in cases:
        assert status == want_status and message in json.loads(body)["error"], (status, body)

    tc = service_client.create_lora_training_client(base_model=MODEL, rank=2).result()
    good = encode(server, "1+1=2")

    def datum(**inputs):
        return types.Datum(model_input=types.ModelInput.from_ints(good[:-1]), loss_fn_inputs=inputs)

    bad = [
        ([datum(target_tokens=good[1:-1])], "cross_entropy", None, "target_tokens'] has shape"),  # one short
        ([datum(target_tokens=good[1:], weights=[1.0, 2.0])], "cross_entropy", None, "loss_fn_inputs['weights']"),
        ([datum(target_tokens=good[1:])], "ppo", None, "'ppo' needs loss_fn_inputs logprobs, advantages"),
        ([datum(target_tokens=good[1:])], "stable_reinforce", None, "'stable_reinforce' is not served"),
        (
            [
                datum(
                    target_tokens=good[1:],
                    logprobs=[0.0] * (len(good) - 1),
                    advantages=[1.0] * (len(good) - 1),
                    sequence_ratio_mask=[0.0] * (len(good) - 1),
                )
            ],
            "gspo",
            None,
            "sequence_ratio_mask marks no token",
        ),
        ([datum(target_tokens=[10**6] * (len(good) - 1))], "cross_entropy", None, "target_tokens must be in"),
    ]
    for data, loss, config, message in bad:
        with pytest.raises(tinker.BadRequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
            tc.forward_backward(data, loss, loss_fn_config=config).result()
    with pytest.raises(tinker.BadRequestError, match="checkpoint name '..'"):
        tc.save_state("..").result()
    # the client is still fine afterwards
    assert tc.forward_backward([datum(target_tokens=good[1:])], "cross_entropy").result().metrics["loss:sum"] > 0


def test_named_sampler_weights_base_sampler_and_prompt_logprobs(server, service_client):
    tc = service_client.create_lora_training_client(base_model=MODEL, rank=2).result()
    tc.forward_backward([sft_datum(encode(server, "5+5=10"), 4)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = tc.save_weights_for_sampler("rev-1").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/rev-1"
    prompt = types.ModelInput.from_ints(encode(server, "5+5="))
    tuned = service_client.create_sampling_client(model_path=path).result()
    base = service_client.create_sampling_client(base_model=MODEL).result()
    lp_tuned = tuned.compute_logprobs(prompt).result()
    lp_base = base.compute_logprobs(prompt).result()
    assert lp_tuned[0] is None and lp_base[0] is None and len(lp_tuned) == prompt.length
    assert lp_tuned[1:] != pytest.approx(lp_base[1:], abs=1e-6)  # the revision is not the base
    # the base sampler's prompt logprobs are the base model's own
    model = server.service.base.model
    ids = torch.tensor([prompt.to_ints()])
    with torch.no_grad():
        want = torch.log_softmax(model(ids).float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0].tolist()
    assert lp_base[1:] == pytest.approx(want, abs=1e-5)
    with pytest.raises(Exception, match="no saved weights"):
        service_client.create_sampling_client(model_path=f"tinker://{tc.model_id}/sampler_weights/missing").result()


@pytest.mark.slow
def test_the_cli_serves_it(tmp_path):
    """`trillora serve tiny-moe-chat --tinker` as written in the README: health, key checked, loopback only."""
    import subprocess
    import sys
    import time

    from engine_helpers import free_port

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trillora",
            "serve",
            "tiny-moe-chat",
            "--tinker",
            "--api-key",
            KEY,
            "--port",
            str(port),
            "--state-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        conn = None
        for _ in range(300):
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/api/v1/healthz")
                assert json.loads(conn.getresponse().read()) == {"status": "ok"}
                break
            except ConnectionRefusedError:
                time.sleep(0.1)
        else:
            pytest.fail("the server did not come up")
        conn.request("POST", "/api/v1/create_session", body=b"{}", headers={"X-API-Key": "tml-other"})
        assert conn.getresponse().status == 401
        conn.close()
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert f"on http://127.0.0.1:{port}" in out
