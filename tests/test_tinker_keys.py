"""Several keys on one Tinker service, attacked by one of them on loopback: it held every session
slot (the operator got 429), queued results it never read (16 MiB each, kept an hour), and saved
named states in a loop (1 GB/s of disk). Each key now holds its share, its unread results are
bounded, and the saved states have a quota."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from engine_helpers import post_json, running_server

from trillora.serve.config import ServeConfig


@pytest.fixture
def serve(tmp_path):
    gens = []

    def start(**kw):
        gen = running_server(ServeConfig(model="tiny-moe", tinker=True, port=0, state_dir=str(tmp_path), **kw))
        gens.append(gen)
        return f"http://127.0.0.1:{next(gen).cfg.port}"

    yield start
    for gen in gens:
        next(gen, None)


def poster(url: str):
    return lambda path, body, key="k1": post_json(url, path, body, key=key)


def status_of(url: str, path: str, body: dict, key: str) -> int:
    """The status alone: a sample's outcome is protobuf, not JSON."""
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"X-API-Key": key, "Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_each_key_holds_only_its_share_of_sessions_and_clients(serve):
    post = poster(serve(api_key=["k1", "k2"], max_sessions=4, max_clients=2))
    held = [post("/api/v1/create_session", {}, key="k2") for _ in range(3)]
    assert [s for s, _ in held] == [200, 200, 429], held
    assert "its share of the server's 4 (2 keys)" in held[2][1]["error"]
    status, out = post("/api/v1/create_session", {})  # the operator still gets one
    assert status == 200, out
    mine, theirs = out["session_id"], held[0][1]["session_id"]

    def client(sid, seq, key) -> dict:  # the future's outcome: clients are made on the worker
        body = {"session_id": sid, "model_seq_id": seq, "base_model": "tiny-moe", "lora_config": {"rank": 2}}
        return post("/api/v1/retrieve_future", post("/api/v1/create_model", body, key=key)[1], key=key)[1]

    assert "model_id" in client(theirs, 0, "k2")
    assert "training clients, its share of the server's 2" in client(theirs, 1, "k2")["error"]
    assert "model_id" in client(mine, 0, "k1")


def test_a_keys_unread_results_are_bounded(serve):
    url = serve(api_key=["k1", "k2"], max_unread_mib=1)
    post = poster(url)
    sample = {
        "base_model": "tiny-moe",
        "prompt": {"chunks": [{"tokens": [5, 6, 7]}]},
        "sampling_params": {"max_tokens": 40, "seed": 0},
        "num_samples": 16,
        "topk_sample_logprobs": 64,
    }
    operators = post("/api/v1/asample", sample)[1]["request_id"]
    queued = [post("/api/v1/asample", sample, key="k2")[1]["request_id"] for _ in range(8)]
    # the newest is kept; the worker ran the calls in order, so all are settled once it is
    assert status_of(url, "/api/v1/retrieve_future", {"request_id": queued[-1]}, "k2") == 200
    status, out = post("/api/v1/retrieve_future", {"request_id": queued[0]}, key="k2")
    assert status == 410 and "dropped unread" in out["error"] and "1 MiB (--max-unread-mib)" in out["error"], out
    assert status_of(url, "/api/v1/retrieve_future", {"request_id": operators}, "k1") == 200  # its own budget


def test_saved_states_have_a_quota(serve):
    post = poster(serve(api_key="k1", max_state_gib=2**-12))  # 256 KiB: one rank-32 save passes it
    sid = post("/api/v1/create_session", {})[1]["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": "tiny-moe", "lora_config": {"rank": 32}}
    made = post("/api/v1/create_model", body)[1]
    mid = post("/api/v1/retrieve_future", {"request_id": made["request_id"]})[1]["model_id"]
    status, saved = post("/api/v1/save_weights", {"model_id": mid, "path": "a", "seq_id": 1})
    assert status == 200, saved
    assert post("/api/v1/retrieve_future", {"request_id": saved["request_id"]})[0] == 200
    status, out = post("/api/v1/save_weights", {"model_id": mid, "path": "b", "seq_id": 2})
    assert status == 403 and "(--max-state-gib)" in out["error"], out
    status, out = post("/api/v1/save_weights_for_sampler", {"model_id": mid, "path": "c", "seq_id": 3})
    assert status == 403, out
