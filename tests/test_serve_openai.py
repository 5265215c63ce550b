"""`trillora serve` as a real process on loopback, and OpenAIEngine against it: logprobs against
the trainer, adapter sync through the LoRA endpoints, refusals, a short RL run over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_helpers import free_port, post_json, running_server, trainer_logprobs, wait_for_health

from trillora import lora
from trillora.checkpoint import load_model, resolve_model_path
from trillora.rollout import EngineError, OpenAIEngine, SamplingParams
from trillora.tasks.prompts import encode_prompt

KEY = "test-key"


def start_server(root):
    """A `trillora serve` process on a free loopback port; None if it exited (e.g. the port was taken meanwhile)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trillora",
            "serve",
            "tiny-moe",
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--adapter-root",
            str(root),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    failure = wait_for_health(proc, url, 120)
    return (None if failure else proc), url, failure or ""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for _ in range(3):
        proc, url, log = start_server(root)
        if proc is not None:
            break
    else:
        raise RuntimeError(f"trillora serve did not come up: {log}")
    yield url, root
    proc.terminate()
    proc.wait(timeout=20)


def post(url, path, body, key=KEY, raw=None):
    return post_json(url, path, body, key, raw)


def test_completions_and_refusals(server):
    url, root = server
    status, out = post(url, "/v1/completions", {"prompt": "rev abc=", "max_tokens": 5, "temperature": 0, "logprobs": 0})
    assert status == 200 and out["choices"][0]["text"] == "cba"
    assert out["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
    assert post(url, "/v1/completions", {"prompt": "1+1="}, key="wrong")[0] == 401
    assert post(url, "/v1/completions", {"prompt": "1+1=", "n": 1000})[0] == 400
    assert post(url, "/v1/completions", {"prompt": [10**9]})[0] == 400
    assert post(url, "/v1/completions", None, raw=b"x" * (2 << 20))[0] == 413
    assert post(url, "/v1/completions", None, raw=b"{nope")[0] == 400
    status, out = post(url, "/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": "../../etc"})
    assert status == 403 and "outside the adapter root" in out["error"]["message"]
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "nothing"})[0] == 404
    status, out = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "no chat template" in out["error"]["message"]
    # fields of the wrong type, too many or too long prompts: a JSON 400 naming the field, never a drop
    for body, message in [
        ({"prompt": "1+1=", "seed": "x"}, "seed must be an integer"),
        ({"prompt": "1+1=", "stop_token_ids": "x"}, "stop_token_ids must be a list"),
        ({"prompt": "1+1=", "temperature": "hot"}, "could not convert"),
        ({"prompt": [[5, 6]] * 65}, "65 prompts; at most 64"),
        ({"prompt": [[5] * 500], "max_tokens": 20}, "over the model's 512 positions"),
    ]:
        status, out = post(url, "/v1/completions", body)
        assert status == 400 and message in out["error"]["message"], (body, out)


@pytest.mark.parametrize("length", ["-1", "-100000", "x"])
def test_a_negative_or_bad_content_length_is_refused_not_read_to_eof(server, length):
    """Read as "until EOF", a negative length would skip the body limit and block the handler."""
    import socket

    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n{{}}".encode()
        )
        reply = b""
        while chunk := sock.recv(65536):  # until the server closes; its 10 s timeout fails a blocked handler
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 400") and "bad Content-Length" in reply
    assert post(url, "/v1/completions", {"prompt": "1+1=", "max_tokens": 2})[0] == 200  # and it serves on


def test_chat_completions_with_a_real_chat_template(tmp_path):
    """tiny-moe-chat's template through /v1/chat/completions: the rendered prompt's ids, not a
    BatchEncoding (what apply_chat_template(tokenize=True) returns in transformers 5); the greedy
    reply equals a separate fp32 engine's on the same ids, and ends at the template's end-of-turn
    token (`<|im_end|>`), not at the tokenizer's end of text."""
    from trillora.rollout import LocalEngine
    from trillora.serve.config import ServeConfig

    gen = running_server(ServeConfig(model="tiny-moe-chat", port=0))
    server = next(gen)
    url, tok = f"http://127.0.0.1:{server.cfg.port}", server.service.tokenizer
    messages = [{"role": "user", "content": "12+34="}]
    status, out = post(
        url, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0}, key=None
    )
    want = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)[
        "input_ids"
    ]
    assert status == 200 and out["usage"]["prompt_tokens"] == len(want)
    engine = LocalEngine(load_model(resolve_model_path("tiny-moe-chat")), precision="fp32")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    greedy = engine.generate(
        [want], 1, SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(tok.eos_token_id, end))
    )[0][0]
    assert greedy.token_ids[-1] == end and out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["message"]["content"] == tok.decode(greedy.token_ids[:-1], skip_special_tokens=True)
    status, out = post(
        url, "/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": 5}]}, key=None
    )
    assert status == 400 and "messages do not fit the chat template" in out["error"]["message"]
    # bounded before the template renders it on the event loop (1 MiB took 1 to 2.3 s of it)
    status, out = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 40_000}]}, key=None)
    assert status == 400 and "positions can hold" in out["error"]["message"]
    next(gen, None)


def test_adapters_are_slots_bounded_by_memory(tmp_path):
    """A loaded adapter is its tensors on the one base: past `adapter_memory_mib` a load is refused
    (400: retrying cannot help) until one is unloaded; /v1/models reports each adapter's bytes and the budget."""
    from trillora.serve.config import ServeConfig

    model = load_model(resolve_model_path("tiny-moe"))
    lora.apply_lora(model, lora.LoraConfig(rank=2))
    lora.save_adapter(model, tmp_path / "a")
    size = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".lora_" in n)
    gen = running_server(
        ServeConfig(model="tiny-moe", port=0, adapter_root=str(tmp_path), adapter_memory_mib=1.5 * size / 2**20)
    )
    url = f"http://127.0.0.1:{next(gen).cfg.port}"
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "one", "lora_path": "a"}, key=None)[0] == 200
    assert (
        post(url, "/v1/load_lora_adapter", {"lora_name": "one", "lora_path": "a"}, key=None)[0] == 200
    )  # replaced, not one more
    status, out = post(url, "/v1/load_lora_adapter", {"lora_name": "two", "lora_path": "a"}, key=None)
    assert status == 400 and "of the adapter memory is free" in out["error"]["message"]
    for bad in ({"lora_name": "x" * 200, "lora_path": "a"}, {"lora_name": ["x"], "lora_path": "a"}):
        assert post(url, "/v1/load_lora_adapter", bad, key=None)[0] == 400
    assert post(url, "/v1/unload_lora_adapter", {}, key=None)[0] == 400
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "one"}, key=None)[0] == 200
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "two", "lora_path": "a"}, key=None)[0] == 200
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        listed = json.loads(r.read())
    assert [m["id"] for m in listed["data"]] == ["tiny-moe", "two"]
    assert [m["adapter_bytes"] for m in listed["data"]] == [0, size]
    assert listed["adapter_memory"]["held_bytes"] == size and listed["adapter_memory"]["limit_bytes"] == int(1.5 * size)
    next(gen, None)


def test_openai_engine_logprobs_and_adapter_sync(server, tmp_path):
    url, root = server
    model = load_model(resolve_model_path("tiny-moe"))
    from trillora import load_tokenizer

    tok = load_tokenizer(resolve_model_path("tiny-moe"))
    prompts = [encode_prompt(tok, "123+456="), encode_prompt(tok, "rev hello=")]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5, stop_token_ids=(tok.eos_token_id,))
    engine = OpenAIEngine(url, model="tiny-moe", sync_dir=root / "sync", api_key=KEY)
    out = [c for g in engine.generate(prompts, 4, params) for c in g]
    assert len(out) == 8 and all(c.token_ids for c in out)
    ours, theirs = trainer_logprobs(model, out)
    assert (ours - theirs).abs().max() < 1e-4  # served fp32 engine == trainer

    lora.apply_lora(model, lora.LoraConfig(rank=4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in lora.lora_parameters(model):
            p.normal_(0, 0.1, generator=g)
    cost = engine.sync(model)
    assert cost["sync_bytes"] > 0 and engine.model == f"tiny-moe-{engine.tag}-r1"
    after = [c for g in engine.generate(prompts, 4, params) for c in g]
    ours, theirs = trainer_logprobs(model, after)
    assert (ours - theirs).abs().max() < 1e-4  # the server now runs the trainer's adapter
    base_again, _ = trainer_logprobs(load_model(resolve_model_path("tiny-moe")), after)
    assert (base_again - theirs).abs().max() > 1e-2  # and it is not the base any more
    first = engine.model
    engine.sync(model)
    req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["tiny-moe", engine.model]
    _, listed = post(url, "/v1/unload_lora_adapter", {"lora_name": first})
    assert listed["error"]["message"] == f"no adapter named {first!r}"  # the old revision was unloaded
    assert not (root / "sync" / first).exists() and (root / "sync" / engine.model).exists()
    engine.close()


def test_unreachable_server_fails_clearly():
    engine = OpenAIEngine(f"http://127.0.0.1:{free_port()}", model="m", retries=1, backoff=0.01, timeout=2)
    with pytest.raises(EngineError, match="failed after 2 attempts"):
        engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2))


def test_rl_steps_through_the_server(server, tmp_path):
    from trillora.config import load_config
    from trillora.trainer import Trainer

    url, root = server
    cfg = load_config(
        None,
        [
            f"out_dir={tmp_path}",
            "name=http",
            "steps=2",
            "eval_every=2",
            'rollout.engine="openai"',
            f'rollout.urls=["{url}"]',
            f'rollout.api_key="{KEY}"',
            f'rollout.sync_dir="{root / "rl"}"',
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "task.eval_problems=16",
            "task.eval_samples=1",
            'task.retention=""',
        ],
    )
    summary = Trainer(cfg).run()
    rows = [json.loads(line) for line in (tmp_path / "http" / "metrics.jsonl").read_text().splitlines()][1:]
    assert summary["steps"] == 2 and all(r["sync_bytes"] > 0 for r in rows)
    assert all(r["mismatch_kl_k3"] < 1e-6 for r in rows)  # fp32 server, same weights: no mismatch


def test_multi_turn_episodes_through_the_server(server, tmp_path):
    """A server engine takes each turn's whole context as token ids (no text round trip): the
    guessing game's episodes train with the trainer scoring exactly the server's tokens."""
    from trillora.config import load_config
    from trillora.trainer import Trainer

    url, root = server
    cfg = load_config(
        "examples/guessing.toml",
        [
            f"out_dir={tmp_path}",
            "name=turns",
            "steps=2",
            "eval_every=2",
            'rollout.engine="openai"',
            f'rollout.urls=["{url}"]',
            f'rollout.api_key="{KEY}"',
            f'rollout.sync_dir="{root / "turns"}"',
            "rollout.prompts_per_step=2",
            "rollout.group_size=4",
            "task.eval_problems=4",
            "task.max_turns=3",
        ],
    )
    Trainer(cfg).run()
    rows = [json.loads(line) for line in (tmp_path / "turns" / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(r["turns_mean"] > 1.0 for r in rows)
    assert all(r["mismatch_kl_k3"] < 1e-6 for r in rows)  # the server's tokens and logprobs, turn after turn


def test_seeded_groups_are_reproducible_and_not_collapsed(server):
    url, _ = server
    engine = OpenAIEngine(url, model="tiny-moe", api_key=KEY)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)
    prompt = [[1, 5, 6, 7, 76, 8, 9, 10, 84]]
    a = [c.token_ids for c in engine.generate(prompt, 6, params)[0]]
    b = [c.token_ids for c in engine.generate(prompt, 6, params)[0]]
    assert a == b and len(a) == 6
    assert len({tuple(t) for t in a}) > 1  # the samples of a group differ
    engine.close()


def test_asynchronous_rl_through_the_server_corrects_against_the_sampling_revision(server, tmp_path):
    """Sampled one update behind (staleness 1) through a real server's adapter revisions: the rollout
    logprobs are the older revision's, so the trainer sees a mismatch there and none on step 1."""
    from trillora.config import load_config
    from trillora.trainer import Trainer

    url, root = server
    cfg = load_config(
        None,
        [
            f"out_dir={tmp_path}",
            "name=async",
            "steps=3",
            "eval_every=3",
            'rollout.engine="openai"',
            f'rollout.urls=["{url}"]',
            f'rollout.api_key="{KEY}"',
            f'rollout.sync_dir="{root / "async"}"',
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "task.eval_problems=16",
            "task.eval_samples=1",
            'task.retention=""',
            "rollout.asynchronous=true",
            "rollout.max_staleness=1",
            "optim.lr=0.02",
            "optim.warmup_steps=1",
        ],
    )
    trainer = Trainer(cfg)
    trainer.run(close_engine=False)
    rows = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert rows[0]["mismatch_kl_k3"] < 1e-6 and all(r["mismatch_kl_k3"] > 1e-6 for r in rows[1:])
    # two revisions stay loaded (a batch sampled from the older one may still be running), older ones go
    served = {
        m["id"]
        for m in json.loads(
            urllib.request.urlopen(
                urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}), timeout=30
            ).read()
        )["data"]
    }
    mine = {m for m in served if trainer.engine.tag in m}
    assert mine == set(trainer.engine.loaded) and len(mine) == 2 and trainer.engine.model in mine
    trainer.engine.close()


@pytest.mark.slow
def test_requests_for_different_adapters_share_a_pass_and_answer_as_alone(tmp_path):
    """Greedy completions for two adapters and the base, sent at once, share passes (each row its own
    adapter) and equal the same requests sent one by one; the benchmark script runs (small)."""
    import threading

    from trillora.serve.config import ServeConfig

    model = load_model(resolve_model_path("tiny-moe"))
    lora.apply_lora(model, lora.LoraConfig(rank=4))
    for i in range(2):
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for _, p in lora.lora_parameters(model):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        lora.save_adapter(model, tmp_path / f"a{i}")
    gen = running_server(ServeConfig(model="tiny-moe", port=0, adapter_root=str(tmp_path), gather_seconds=0.2))
    server = next(gen)
    url = f"http://127.0.0.1:{server.cfg.port}"
    for i in range(2):
        assert post(url, "/v1/load_lora_adapter", {"lora_name": f"a{i}", "lora_path": f"a{i}"}, key=None)[0] == 200
    bodies = [
        {"model": m, "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 8, "temperature": 0, "logprobs": 1}
        for m in ("a0", "a1", "tiny-moe")
    ]
    alone = [post(url, "/v1/completions", b, key=None)[1]["choices"] for b in bodies]
    before, together = server.worker.fused_batches, [None] * 3

    def send(i):
        together[i] = post(url, "/v1/completions", bodies[i], key=None)[1]["choices"]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    next(gen, None)
    assert server.worker.fused_batches > before
    assert alone[0] != alone[1] != alone[2]  # three different policies
    for a, b in zip(alone, together, strict=True):
        assert [c["token_ids"] for c in a] == [c["token_ids"] for c in b]
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x["logprobs"]["token_logprobs"], y["logprobs"]["token_logprobs"], atol=1e-5)

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "served_adapters.py"
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [
            sys.executable,
            str(script),
            "--adapters",
            "3",
            "--clients",
            "2",
            "--requests",
            "2",
            "--max-tokens",
            "4",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["models_listed"] == 4 and report["completion_tokens"]["waiting requests share a pass"] == 2 * 2 * 4


def test_seeded_requests_of_several_clients_share_one_decode_and_keep_their_tokens():
    """Each client its own `seed`, temperature and `max_tokens` (as OpenAI clients send them): the
    requests that wait together are sampled in ONE decode, and each gets the tokens it gets alone.
    Before, a seeded request was a decode of its own, so seeded clients were served one at a time."""
    import threading

    from trillora.serve.config import ServeConfig

    gen = running_server(ServeConfig(model="tiny-moe", port=0, gather_seconds=0.3))
    server = next(gen)
    url, engine = f"http://127.0.0.1:{server.cfg.port}", server.service.engine
    bodies = [
        {"prompt": [5, 6, 7 + i], "max_tokens": 4 + i, "temperature": 0.5 + 0.1 * i, "seed": 100 + i, "n": 2}
        for i in range(6)
    ]
    alone = [post(url, "/v1/completions", b, key=None)[1]["choices"] for b in bodies]
    decodes, generate = [], engine.generate
    engine.generate = lambda prompts, *a, **k: decodes.append(len(prompts)) or generate(prompts, *a, **k)
    together = [None] * len(bodies)

    def send(i):
        together[i] = post(url, "/v1/completions", bodies[i], key=None)[1]["choices"]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    next(gen, None)
    assert len(decodes) < len(bodies) and max(decodes) > 1, decodes  # requests shared a decode
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert [c["token_ids"] for c in a] == [c["token_ids"] for c in b], i
        assert all(len(c["token_ids"]) <= 4 + i for c in b)
    assert len({tuple(c["token_ids"]) for c in alone[0]}) == 2  # a request's n samples differ


def test_a_chats_next_call_prefills_only_its_new_tokens():
    """Two turns of one chat: the second call's prompt holds the first call's prompt and reply, whose
    keys and values the sampler still holds (the same weights), so it prefills only what the turn
    added (the tokens counted)."""
    from trillora.serve.config import ServeConfig

    gen = running_server(ServeConfig(model="tiny-moe-chat", port=0))
    server = next(gen)
    url, engine = f"http://127.0.0.1:{server.cfg.port}", server.service.engine
    turn = [{"role": "user", "content": "12+30="}]
    body = {"messages": turn, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    first = post(url, "/v1/chat/completions", body, key=None)[1]
    reply = first["choices"][0]
    turn += [reply["message"], {"role": "user", "content": "and 1+1="}]
    before = engine.prefilled_tokens
    second = post(url, "/v1/chat/completions", {**body, "messages": turn}, key=None)[1]
    prompt, held = second["prompt_token_ids"], first["prompt_token_ids"] + reply["token_ids"][:-1]
    assert prompt[: len(held)] == held  # the history as served (its last sampled token was never fed)
    assert engine.prefilled_tokens - before == len(prompt) - len(held)  # 27 of 55: the new turn only
    next(gen, None)
