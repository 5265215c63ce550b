"""Every face encodes a prompt as the trainer does: a text prompt on `/v1/completions` and a chat on
`/v1/chat/completions` become the ids `trillora train` samples from, for every shipped model.

Served completions once left out the BOS the trainer puts first: `864+394=` was answered `989` by
the base and by a trained adapter alike (0 of 40 right), while the trainer's eval answered 1258.
"""

from __future__ import annotations

import pytest
from engine_helpers import post_json, running_server

from trillora.checkpoint import SHIPPED_CHECKPOINTS, load_model, load_tokenizer
from trillora.rollout import LocalEngine, SamplingParams
from trillora.serve.config import ServeConfig
from trillora.tasks import Problem
from trillora.tasks.prompts import encode_problem

PROMPTS = ("864+394=", "rev abc=")
CHAT = [{"role": "user", "content": "What is 12+30?"}]


@pytest.fixture(scope="module", params=SHIPPED_CHECKPOINTS)
def served(request):
    gen = running_server(ServeConfig(model=request.param, port=0))
    server = next(gen)
    yield request.param, f"http://127.0.0.1:{server.cfg.port}"
    next(gen, None)


def test_completion_prompts_are_encoded_as_the_trainer_encodes_them(served):
    model, url = served
    tokenizer = load_tokenizer(model)
    trained = [encode_problem(tokenizer, Problem(prompt=p, answer="")) for p in PROMPTS]
    assert all(ids[0] == tokenizer.bos_token_id for ids in trained)
    status, out = post_json(
        url, "/v1/completions", {"prompt": list(PROMPTS), "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    )
    assert status == 200, out
    assert out["prompt_token_ids"] == trained
    # the served answers are the trainer's engine's greedy answers on those ids
    engine = LocalEngine(load_model(model), precision="fp32")
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(tokenizer.eos_token_id,))
    greedy = engine.generate(trained, 1, params)
    assert [c["token_ids"] for c in out["choices"]] == [g[0].token_ids for g in greedy]
    if model == "tiny-moe":  # the shipped model adds: without BOS it answered 989
        assert out["choices"][0]["text"].startswith("1258")
    # a prompt that already starts with BOS keeps one, as a user pasting the trainer's text would expect
    status, again = post_json(
        url, "/v1/completions", {"prompt": "<bos>864+394=", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    )
    assert status == 200 and again["prompt_token_ids"] == trained[:1]


def test_chat_prompts_are_encoded_as_the_trainer_encodes_them(served):
    model, url = served
    tokenizer = load_tokenizer(model)
    body = {"messages": CHAT, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    status, out = post_json(url, "/v1/chat/completions", body)
    if tokenizer.chat_template is None:  # tiny-moe has no chat template: a clear 400, no guessed rendering
        assert status == 400 and "no chat template" in out["error"]["message"]
        return
    assert status == 200, out
    assert out["prompt_token_ids"] == encode_problem(tokenizer, Problem(prompt="", answer="", messages=CHAT))


def test_load_lora_adapter_body_path_rule_and_base_check(tmp_path, monkeypatch):
    """vLLM's body (`lora_name`, `lora_path`); a relative `lora_path` is resolved against
    `--adapter-root` and the 404 says so; an adapter of another base is refused, naming both."""
    from trillora import lora
    from trillora.checkpoint import resolve_model_path
    from trillora.checkpoint.weights import base_fingerprint

    for base in SHIPPED_CHECKPOINTS:
        model = load_model(base)
        lora.apply_lora(model, lora.LoraConfig(rank=4, alpha=8.0, targets=("mlp", "experts")))
        folder = resolve_model_path(base)
        fingerprint = base_fingerprint(folder)
        lora.save_adapter(
            model, tmp_path / base / "fused", "fused", base_model=str(folder), base_fingerprint=fingerprint
        )
    gen = running_server(ServeConfig(model="tiny-moe-chat", port=0, adapter_root=str(tmp_path)))
    url = f"http://127.0.0.1:{next(gen).cfg.port}"
    try:
        status, out = post_json(url, "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": "tiny-moe-chat/fused"})
        assert (status, out) == (200, {"status": "ok", "lora_name": "mine"})
        status, out = post_json(url, "/v1/completions", {"model": "mine", "prompt": "1+1=", "max_tokens": 2})
        assert status == 200
        status, out = post_json(url, "/v1/load_lora_adapter", {"lora_name": "other", "lora_path": "tiny-moe/fused"})
        message = out["error"]["message"]
        assert status == 400 and "trained on another base" in message and "'tiny-moe-chat'" in message, out
        assert str(tmp_path) not in message
        status, out = post_json(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "runs/default/adapter"})
        assert status == 404 and "resolved against --adapter-root" in out["error"]["message"]
        assert str(tmp_path) not in out["error"]["message"]  # no server path leaves the server
        # a path from the server's working folder: the 404 says what it is under the root
        monkeypatch.chdir(tmp_path.parent)
        given = f"{tmp_path.name}/tiny-moe-chat/fused"
        status, out = post_json(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": given})
        assert status == 404 and "try 'tiny-moe-chat/fused'" in out["error"]["message"], out
        # a run's adapter folder (both layouts in it) loads its fused layout
        status, out = post_json(url, "/v1/load_lora_adapter", {"lora_name": "run", "lora_path": "tiny-moe-chat"})
        assert status == 200, out
        status, out = post_json(url, "/v1/load_lora_adapter", {"lora_name": "y", "lora_path": "/etc"})
        assert status == 403 and "outside the adapter root" in out["error"]["message"]
        assert str(tmp_path) not in out["error"]["message"]
    finally:
        next(gen, None)
