"""The Tinker routes against clients that misbehave, on loopback: declared shapes with no data,
tokens past the model's positions or the per-call bound, guessed or replayed ids, sessions that
never end, names and files planted to escape the state folder. Each refusal is a 4xx naming the
culprit; nothing is allocated from a declared size, and what a session holds can be freed."""

from __future__ import annotations

import json
import time

import pytest
from engine_helpers import running_server
from test_serve_http import KEY, keyed
from test_tinker_wire import request as datum_bytes
from test_tinker_wire import tensor

from trillora.serve.config import ServeConfig
from trillora.serve.tinker import wire

POSITIONS = 512  # tiny-moe's


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_server(
        ServeConfig(
            model="tiny-moe",
            tinker=True,
            port=0,
            api_key=KEY,
            max_clients=2,
            max_samplers=2,
            max_sessions=6,
            max_call_tokens=600,
            state_dir=str(tmp_path_factory.mktemp("state")),
        )
    )


def post(server, path: str, body: dict) -> tuple[int, dict]:
    return keyed(server.cfg.port, "POST", path, body)


def result(server, created: dict) -> dict:
    status, out = post(server, "/api/v1/retrieve_future", {"request_id": created["request_id"]})
    assert status == 200, out
    return out


def session(server) -> str:
    return post(server, "/api/v1/create_session", {})[1]["session_id"]


def client(server, sid: str, seq: int = 0) -> str:
    status, created = post(
        server,
        "/api/v1/create_model",
        {"session_id": sid, "model_seq_id": seq, "base_model": "tiny-moe", "lora_config": {"rank": 2}},
    )
    assert status == 200, created
    return result(server, created)["model_id"]


def forward_backward(server, model_id: str, seq: int, datums: bytes) -> tuple[int, dict]:
    body = wire.put_bytes(1, model_id.encode()) + wire.put_varint(2, seq) + datums + wire.put_bytes(4, b"cross_entropy")
    head = (
        f"POST /api/v1/forward_backward HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY}\r\n"
        f"Content-Type: application/x-protobuf\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    from test_serve_http import request, status_and_json

    return status_and_json(request(server.cfg.port, head.encode() + body))


def finish(server, sid: str) -> None:
    assert post(server, f"/api/v1/sessions/{sid}/finish", {"reason": {"type": "success"}})[0] == 200


def test_ids_cannot_be_guessed_and_a_result_is_read_once(server):
    a, b = session(server), session(server)
    assert len(a) > 20 and a != b
    mid = client(server, a)
    created = post(server, "/api/v1/optim_step", {"model_id": mid, "seq_id": 1, "adam_params": {"learning_rate": 0.0}})[
        1
    ]
    assert len(created["request_id"]) > 20
    assert "metrics" in result(server, created)
    status, out = post(server, "/api/v1/retrieve_future", {"request_id": created["request_id"]})
    assert status == 404, out  # released once retrieved
    finish(server, a)
    finish(server, b)


def test_declared_shapes_and_token_counts_are_bounded(server):
    sid = session(server)
    mid = client(server, sid)
    cases = [
        (
            datum_bytes([1, 2, 3], target_tokens=tensor([3], 2, bytes(24)), weights=tensor([3, 50_000_000])),
            "at most 192 values",
        ),
        (datum_bytes([1, 2, 3], target_tokens=tensor([3, 2_000_000], 2)), "at most 192 values"),
        (
            datum_bytes(
                [1, 2, 3], target_tokens=tensor([3], 2, bytes(24)), weights=tensor([2, 4], csr=([1.0], [0, 1, 1], [-1]))
            ),
            "columns",
        ),
        (datum_bytes(list(range(550)), target_tokens=tensor([550], 2, bytes(8 * 550))), f"{POSITIONS} positions"),
        (datum_bytes(list(range(400)), target_tokens=tensor([400], 2, bytes(8 * 400))) * 2, "more than 600 tokens"),
    ]
    for seq, (datums, message) in enumerate(cases, start=1):
        status, out = forward_backward(server, mid, seq, datums)
        assert status == 400 and message in out["error"], (message, out)
    ok = forward_backward(server, mid, len(cases) + 1, datum_bytes([1, 2, 3], target_tokens=tensor([3], 2, bytes(24))))
    assert ok[0] == 200, ok  # a datum within the bounds is taken
    sample = {
        "base_model": "tiny-moe",
        "prompt": {"chunks": [{"tokens": [5] * 500}]},
        "sampling_params": {"max_tokens": 100},
        "num_samples": 1,
    }
    status, out = post(server, "/api/v1/asample", sample)
    assert status == 400 and f"the model has {POSITIONS}" in out["error"], out
    sample["sampling_params"], sample["num_samples"] = {"max_tokens": 10}, 2  # 2 × 510 tokens > 600
    status, out = post(server, "/api/v1/asample", sample)
    assert status == 400 and "--max-call-tokens" in out["error"], out
    status, out = post(server, "/api/v1/asample", {**sample, "prompt": {"chunks": [{"tokens": [True, 5]}]}})
    assert status == 400 and "integers" in out["error"], out
    for stop, says in (
        (["never"] * 65, "at most 64 entries of at most 256 characters"),  # each is looked for on the shared worker
        (["x" * 257], "at most 64 entries of at most 256 characters"),
        (["a\ufffd"], "may not hold U+FFFD"),
    ):
        sample["sampling_params"], sample["num_samples"] = {"max_tokens": 10, "stop": stop}, 1
        status, out = post(server, "/api/v1/asample", sample)
        assert status == 400 and says in out["error"], out
    finish(server, sid)


def test_a_completion_is_cut_where_its_text_first_holds_a_stop_string():
    """Bisection against the token-by-token scan it replaced (20,000 stop strings × 400 tokens of
    decodes held the worker 285 s)."""
    from transformers import AutoTokenizer

    from trillora.checkpoint.hf import resolve_model_path
    from trillora.rollout.types import Completion
    from trillora.serve.calls import cut_at_stop

    tok = AutoTokenizer.from_pretrained(resolve_model_path("tiny-moe"))
    tokens = tok("12+34=46 and 7*8=56; done", add_special_tokens=False)["input_ids"]
    c = Completion(prompt_ids=[], token_ids=tokens, logprobs=[-0.5] * len(tokens), finish_reason="length")

    def scan(stops):
        for k in range(1, len(tokens) + 1):
            if any(s in tok.decode(tokens[:k]) for s in stops):
                return tokens[:k], c.logprobs[:k], "stop"
        return tokens, c.logprobs, "length"

    for stops in [("=",), ("46",), ("56;",), ("done",), ("never",), ("8=", "+"), ("12+34=46 and 7*8=56; done",)]:
        assert cut_at_stop(c, stops, tok) == scan(stops), stops
    assert cut_at_stop(c, ("56",), tok)[0] == tok("12+34=46 and 7*8=56", add_special_tokens=False)["input_ids"]


def test_a_model_is_created_once_and_a_seq_id_runs_once(server):
    sid = session(server)
    mid = client(server, sid)
    status, out = post(server, "/api/v1/create_model", {"session_id": sid, "model_seq_id": 0, "base_model": "tiny-moe"})
    assert status == 409 and "taken" in out["error"], out
    status, out = post(
        server, "/api/v1/create_model", {"session_id": sid, "model_seq_id": {"a": 1}, "base_model": "tiny-moe"}
    )
    assert status == 400 and "model_seq_id" in out["error"], out
    step = {"model_id": mid, "seq_id": 1, "adam_params": {"learning_rate": 0.0}}
    result(server, post(server, "/api/v1/optim_step", step)[1])
    status, out = post(server, "/api/v1/optim_step", step)
    assert status == 409 and "already sent" in out["error"], out
    finish(server, sid)


def test_finishing_a_session_frees_its_clients_and_samplers(server):
    sid = session(server)
    client(server, sid, 0), client(server, sid, 1)
    status, out = post(server, "/api/v1/create_model", {"session_id": sid, "model_seq_id": 2, "base_model": "tiny-moe"})
    assert status == 200 and "--max-clients" in json.dumps(result(server, out))  # 2 held: the third is refused
    for seq in (0, 1):
        assert (
            post(
                server,
                "/api/v1/create_sampling_session",
                {"session_id": sid, "sampling_session_seq_id": seq, "base_model": "tiny-moe"},
            )[0]
            == 200
        )
    status, out = post(
        server,
        "/api/v1/create_sampling_session",
        {"session_id": sid, "sampling_session_seq_id": 2, "base_model": "tiny-moe"},
    )
    assert status == 429 and "--max-samplers" in out["error"], out
    finish(server, sid)
    status, out = post(server, "/api/v1/session_heartbeat", {"session_id": sid})
    assert status == 410, out  # the SDK stops its heartbeat on 410
    other = session(server)
    client(server, other, 0), client(server, other, 1)  # the finished session's two slots are free again
    finish(server, other)


def test_a_recipes_per_step_samplers_make_room_for_the_next(server):
    """An RL loop saves an unnamed revision per step and samples with the newest: at the cap the
    session's oldest unnamed one goes; a sampler made by name stays."""
    sid = session(server)
    mid = client(server, sid)
    assert (
        post(
            server,
            "/api/v1/create_sampling_session",
            {"session_id": sid, "sampling_session_seq_id": 0, "base_model": "tiny-moe"},
        )[0]
        == 200
    )
    made = []
    for step in range(1, 4):
        out = post(
            server,
            "/api/v1/save_weights_for_sampler",
            {"model_id": mid, "seq_id": step, "sampling_session_seq_id": step},
        )[1]
        made.append(result(server, out)["sampling_session_id"])
    held = server.service.sessions[sid].samplers
    assert list(held) == [f"{sid}:sample:0", made[-1]]  # the named one and the newest
    prompt = {"prompt": {"chunks": [{"tokens": [5, 6]}]}, "sampling_params": {"max_tokens": 1}}
    assert post(server, "/api/v1/asample", {"sampling_session_id": made[0], **prompt})[0] == 404
    assert post(server, "/api/v1/asample", {"sampling_session_id": made[-1], **prompt})[0] == 200
    finish(server, sid)


def test_sessions_are_capped_and_idle_ones_end():
    gen = running_server(
        ServeConfig(model="tiny-moe", tinker=True, port=0, api_key=KEY, max_sessions=2, session_seconds=1.0)
    )
    srv = next(gen)
    try:
        a = session(srv)
        client(srv, a)
        session(srv)
        status, out = post(srv, "/api/v1/create_session", {})
        assert status == 429 and "--max-sessions" in out["error"], out
        time.sleep(1.5)  # no heartbeat: both end when the next session is asked for
        assert post(srv, "/api/v1/create_session", {})[0] == 200
        assert post(srv, "/api/v1/session_heartbeat", {"session_id": a})[0] == 410
        assert sum(len(s.models) for s in srv.service.sessions.values()) == 0  # its client freed
    finally:
        next(gen, None)


def test_names_with_a_newline_and_planted_links_are_refused(server, tmp_path):
    sid = session(server)
    mid = client(server, sid)
    status, out = post(server, "/api/v1/save_weights", {"model_id": mid, "path": "ok\n", "seq_id": 1})
    assert status == 400 and "checkpoint name" in out["error"], out
    saved = result(server, post(server, "/api/v1/save_weights", {"model_id": mid, "path": "good", "seq_id": 2})[1])[
        "path"
    ]
    folder = server.service.resolve(saved)[2]
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"rank": 987654321}))
    (folder / "state.json").unlink()
    status, out = post(server, "/api/v1/weights_info", {"tinker_path": saved})
    assert status == 404 and "no saved weights" in out["error"], out  # a folder without state.json: no traceback
    (folder / "state.json").symlink_to(secret)
    status, out = post(server, "/api/v1/weights_info", {"tinker_path": saved})
    assert status == 403 and "link" in out["error"] and "987654321" not in json.dumps(out), out
    finish(server, sid)


@pytest.mark.slow
def test_the_attack_benchmark_keeps_every_honest_request_answered(tmp_path):
    """`benchmarks/tinker_under_attack.py` at a small size: 2 trainers and 2 samplers of the real SDK
    and the operator's recorded completions, alone and then beside hostile shapes, seq_id games, slow
    connections, keyless bodies and slots, a guest's trace store flood and run-metadata loop."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "tinker_under_attack.py"
    out = tmp_path / "attack.json"
    run = subprocess.run(
        [sys.executable, str(script), "--clients", "2", "--samplers", "2", "--steps", "2", "--operator-requests", "10"]
        + ["--max-trace-mib", "4", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    for phase in ("alone", "budget attacks", "every attack"):  # every request of each phase answered
        assert r["honest_requests"][phase] == {"ok": 2 * 2 * 2 + 2 * 2 + 10, "failed": 0}, r["honest_requests"]
    for kind in ("shapes", "seq_games", "keyless"):
        assert r["attacks"][kind]["refused"] > 0 and r["attacks"][kind]["accepted"] == 0, (kind, r["attacks"][kind])
    assert r["attacks"]["slow"]["dropped by the server"] > 0  # at the header deadline
    assert r["attacks"]["keyless_slots"]["closed by the server"] > 0
    flood, meta, disk = r["attacks"]["store_flood"], r["attacks"]["metadata_loop"], r["disk"]
    assert flood["served"] >= 1 and flood["refused"] > 0 and set(flood) == {"served", "refused"}, flood
    assert disk["guest_trace_bytes"] >= 4 * 2**20 and r["disk_within_budgets"], disk
    assert meta["made"] == 3 * 2 + 4 and meta["refused"] > 0, meta  # the guest's share: a third of --max-clients
    assert set(r["healthz"]) == {"200"} and r["healthz_at_the_end"] == 200 and r["within_bound"], r
