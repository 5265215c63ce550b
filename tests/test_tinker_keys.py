"""Several keys on one Tinker service, attacked by one of them on loopback: it held every session
slot (the operator got 429), queued results it never read (16 MiB each, kept an hour), and saved
named states in a loop (1 GB/s of disk). Each key now holds its share, its unread results are
bounded, and the saved states have a quota."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
from engine_helpers import post_json, running_server

from trillora.serve.config import ServeConfig

PROTO = "application/x-protobuf"


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


def read(url: str, rid: str, key: str) -> tuple[int, str]:
    """Poll until the outcome is there, as the SDK does: (status, content type)."""
    while True:
        status, kind = status_of(url, "/api/v1/retrieve_future", {"request_id": rid}, key)
        if (status, kind) != (200, "application/json"):  # JSON with 200 is a try_again here
            return status, kind


def status_of(url: str, path: str, body: dict, key: str) -> tuple[int, str]:
    """The status and content type: a sample's outcome is protobuf (a `try_again` is JSON)."""
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"X-API-Key": key, "Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers.get("content-type", "")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type", "")


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


def test_every_rank_admits_what_rank_0_admits():
    """Under torchrun the other ranks replay rank 0's commands: their sessions learn their owner from
    the command (`Registry.own`), so a share refuses, and an unnamed sampler makes room, on every rank
    alike (a rank holding a client rank 0 refused would leave a pass's collectives unmatched)."""
    from trillora.policy.adapters import Revision
    from trillora.serve.calls import BadRequest
    from trillora.serve.registry import Client, Registry

    cfg = ServeConfig(model="tiny-moe", api_key=["k1", "k2"], max_clients=4, max_samplers=4)
    ranks = [Registry(cfg, follower=False), Registry(cfg, follower=True)]
    guest, operator = (ranks[0].create_session(o) for o in ("guest", "op"))
    outcomes = [[], []]
    steps = [(guest, "client", n) for n in range(3)] + [(operator, "client", 0)]
    steps += [(guest, "sampler", n) for n in range(4)] + [(operator, "sampler", 0)]
    for sid, what, n in steps:
        owner = ranks[0].owner(sid)  # what the command carries
        for r, registry in enumerate(ranks):
            registry.own(sid, owner)
            try:
                if what == "client":
                    registry.register(sid, n, Client("", None, 2, ("attention",)))
                else:
                    registry.add_sampler(sid, n, Revision(None), ephemeral=True)
                outcomes[r].append("ok")
            except BadRequest as e:
                outcomes[r].append(e.status)
    assert outcomes[0] == outcomes[1] == ["ok", "ok", 429, "ok", "ok", "ok", "ok", "ok", "ok"], outcomes
    for a, b in zip(ranks[0].sessions.values(), ranks[1].sessions.values(), strict=True):
        assert (list(a.models), list(a.samplers)) == (list(b.models), list(b.samplers))
    assert [k.rsplit(":", 1)[1] for k in ranks[0].sessions[guest].samplers] == ["2", "3"]  # its share: 2, newest


def test_a_keys_unread_results_are_bounded(serve):
    url = serve(api_key=["k1", "k2"], max_unread_mib=1, poll_seconds=0.2)
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
    # the worker runs calls in order: all are settled once the last is; a result unread for poll_seconds
    # may go, and the next settled result sees to it
    assert read(url, queued[-1], "k2") == (200, PROTO)
    time.sleep(0.5)
    more = post("/api/v1/asample", sample, key="k2")[1]["request_id"]
    assert read(url, more, "k2") == (200, PROTO)
    status, out = post("/api/v1/retrieve_future", {"request_id": queued[0]}, key="k2")
    assert status == 410 and "dropped unread" in out["error"] and "1 MiB (--max-unread-mib)" in out["error"], out
    assert read(url, operators, "k1") == (200, PROTO)  # its own budget


def test_a_key_holds_a_bounded_number_of_requests(serve):
    """20,000 one-token samples of one key were all taken (and held the worker 427 s): a key's queued
    and unread requests are counted, and past --max-futures it is told to read its results first."""
    url = serve(api_key=["k1", "k2"], max_futures=3)
    post = poster(url)
    sample = {"base_model": "tiny-moe", "prompt": {"chunks": [{"tokens": [5]}]}, "sampling_params": {"max_tokens": 1}}
    held = [post("/api/v1/asample", sample, key="k2") for _ in range(4)]
    assert [s for s, _ in held] == [200, 200, 200, 429], held
    assert "holds 3 requests not yet retrieved (--max-futures)" in held[3][1]["error"]
    assert post("/api/v1/asample", sample)[0] == 200  # another key's count
    assert read(url, held[0][1]["request_id"], "k2") == (200, PROTO)  # one read, one more may come
    assert post("/api/v1/asample", sample, key="k2")[0] == 200


def test_a_numbered_call_refused_for_the_cap_keeps_its_number(serve):
    """A training client's optim_step refused with 429 (the key at --max-futures) used up its seq_id: the
    SDK's retry got 409 and the step was lost."""
    url = serve(api_key="k1", max_futures=2)
    post = poster(url)
    sid = post("/api/v1/create_session", {})[1]["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": "tiny-moe", "lora_config": {"rank": 2}}
    mid = post("/api/v1/retrieve_future", post("/api/v1/create_model", body)[1])[1]["model_id"]
    sample = {"base_model": "tiny-moe", "prompt": {"chunks": [{"tokens": [5]}]}, "sampling_params": {"max_tokens": 1}}
    held = [post("/api/v1/asample", sample)[1]["request_id"] for _ in range(2)]
    step = {"model_id": mid, "seq_id": 1, "adam_params": {"learning_rate": 1e-4}}
    status, out = post("/api/v1/optim_step", step)
    assert status == 429 and "--max-futures" in out["error"], out
    assert read(url, held[0], "k1") == (200, PROTO)
    status, out = post("/api/v1/optim_step", step)  # the SDK's retry, same number
    assert status == 200 and "request_id" in out, out


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


def test_saves_queued_together_are_checked_again_when_they_run(serve):
    """Both pass the route's check before either is written; the second fails on the worker."""
    post = poster(serve(api_key="k1", max_state_gib=2**-12))
    sid = post("/api/v1/create_session", {})[1]["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": "tiny-moe", "lora_config": {"rank": 32}}
    mid = post("/api/v1/retrieve_future", post("/api/v1/create_model", body)[1])[1]["model_id"]
    busy = {"base_model": "tiny-moe", "prompt": {"chunks": [{"tokens": [5]}]}, "num_samples": 64}
    busy["sampling_params"] = {"max_tokens": 400}
    post("/api/v1/asample", busy)  # the worker is busy while both saves arrive
    queued = [post("/api/v1/save_weights", {"model_id": mid, "path": p, "seq_id": n}) for n, p in ((1, "a"), (2, "b"))]
    assert [s for s, _ in queued] == [200, 200], queued
    first, second = (post("/api/v1/retrieve_future", out)[1] for _, out in queued)
    assert "path" in first and "(--max-state-gib)" in second["error"], (first, second)


def _disk(folder) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_run_metadata_is_bounded_counted_with_the_states_and_goes_with_its_run(serve, tmp_path):
    """`user_metadata` of create_model went to `<state-dir>/<run>/run.json` with no bound, outside
    --max-state-gib, and stayed for good: 16 MiB per client in a loop filled 1.4 GB against a 0.5 GiB
    quota, after which every key's saves got 403 with nothing in the API to free them."""
    url = serve(api_key="k1", max_state_gib=2**-12)  # 256 KiB: one rank-32 save passes it
    post = poster(url)

    def model(sid: str, metadata: dict) -> tuple[int, dict]:
        body = {"session_id": sid, "model_seq_id": 0, "base_model": "tiny-moe", "lora_config": {"rank": 32}}
        status, out = post("/api/v1/create_model", {**body, "user_metadata": metadata})
        return (status, out) if status != 200 else post("/api/v1/retrieve_future", out)

    sid = post("/api/v1/create_session", {})[1]["session_id"]
    status, out = model(sid, {"blob": "x" * (1 << 20)})
    assert status == 400 and "at most 16 KiB (--max-metadata-kib)" in out["error"], out
    assert _disk(tmp_path) == 0
    mid = model(sid, {})[1]["model_id"]
    for n, ttl in enumerate(("x", -1, 1.5)):  # refused before anything is written (written, it went uncounted)
        status, out = post(
            "/api/v1/save_weights", {"model_id": mid, "path": f"t{n}", "seq_id": n + 1, "ttl_seconds": ttl}
        )
        assert status == 400 and "ttl_seconds=" in out["error"], out
    assert not (tmp_path / mid.replace(":", "_") / "weights").exists()
    assert post(f"/api/v1/sessions/{sid}/finish", {})[0] == 200
    assert _disk(tmp_path) == 0
    for _ in range(6):  # a loop of clients with metadata: each run's record goes when its session ends
        sid = post("/api/v1/create_session", {})[1]["session_id"]
        status, out = model(sid, {"blob": "x" * 15000})
        assert status == 200 and "model_id" in out, out
        assert 15000 < _disk(tmp_path) < 16 * 1024
        assert post(f"/api/v1/sessions/{sid}/finish", {})[0] == 200
        assert _disk(tmp_path) == 0
    # a run with a saved state keeps its record until the last state goes; the states and the
    # records share the quota: full, a record with metadata is refused as a save is
    sid = post("/api/v1/create_session", {})[1]["session_id"]
    mid = model(sid, {"a": "b"})[1]["model_id"]
    saved = post("/api/v1/save_weights", {"model_id": mid, "path": "a", "seq_id": 1})[1]
    assert "path" in post("/api/v1/retrieve_future", saved)[1]
    status, out = model(post("/api/v1/create_session", {})[1]["session_id"], {"blob": "x" * 15000})
    assert "(--max-state-gib)" in out.get("error", ""), out
    assert post(f"/api/v1/sessions/{sid}/finish", {})[0] == 200
    assert (tmp_path / mid.replace(":", "_") / "run.json").is_file()  # the saved state still names the run
    gone = f"{url}/api/v1/training_runs/{mid}/checkpoints/weights/a"
    urllib.request.urlopen(urllib.request.Request(gone, method="DELETE", headers={"X-API-Key": "k1"}), timeout=60)
    assert not (tmp_path / mid.replace(":", "_")).exists()


def test_a_save_counts_its_own_run_not_every_saved_state(tmp_path, monkeypatch):
    """`check_room` walked the whole state folder on every save, on the worker: with many saved states
    every key's save got slow. The quota holds, and a save reads only its own run's files."""
    import os

    from trillora.serve.calls import BadRequest
    from trillora.serve.tinker.checkpoints import CheckpointStore

    for i in range(200):  # another run's many saved states
        (tmp_path / "s1_train_0" / "weights" / f"w{i}").mkdir(parents=True)
        (tmp_path / "s1_train_0" / "weights" / f"w{i}" / "adapter.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "learner" / "revision-1").mkdir(parents=True)  # not a saved state: outside the quota
    (tmp_path / "learner" / "revision-1" / "adapter.safetensors").write_bytes(b"x" * (1 << 20))
    store = CheckpointStore(tmp_path, "tiny-moe", max_bytes=1 << 20)
    store.check_room()  # the first check counts every run once
    stats = []
    real = os.lstat
    monkeypatch.setattr(os, "lstat", lambda p, *a, **k: stats.append(p) or real(p, *a, **k))
    mine = tmp_path / "s2_train_0" / "weights" / "a"
    mine.mkdir(parents=True)
    (mine / "adapter.safetensors").write_bytes(b"x" * 4096)
    (mine / "state.json").write_text("{}")
    store.recount(mine)  # what a save does once written
    store.check_room()
    assert 0 < len(stats) <= 6 and all("s2_train_0" in str(p) for p in stats), stats  # the whole folder: 200+
    (mine / "adapter.safetensors").write_bytes(b"x" * (1 << 20))  # this run grows past the quota
    store.recount(mine)
    with pytest.raises(BadRequest, match="--max-state-gib"):
        store.check_room()
    store.delete("s2:train:0", "weights/a")
    store.check_room()  # its deletion freed the room


@pytest.mark.slow
def test_a_guests_adapter_driven_non_finite_stays_its_own(tmp_path):
    """A guest key steps its own adapter with a huge learning rate (1e30: finite weights, non-finite
    activations) and samples from it while the operator samples: the operator's samples are what
    they were alone (the worker fuses passes per key, never one key's rows with another's), and the
    guest's next loss is refused by name."""
    import threading

    tinker = pytest.importorskip("tinker")
    from engine_helpers import tinker_server
    from tinker import types

    gen = tinker_server(tmp_path, ["tml-operator", "tml-guest"])
    server = next(gen)
    url = f"http://127.0.0.1:{server.cfg.port}"
    op, guest = (tinker.ServiceClient(base_url=url, api_key=k) for k in ("tml-operator", "tml-guest"))
    try:
        enc = lambda text: server.service.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        tokens = enc("123+456=579")
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
        )
        clients = [c.create_lora_training_client(base_model="tiny-moe-chat", rank=4).result() for c in (op, guest)]
        for tc, lr in zip(clients, (1e-3, 1e30), strict=True):
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=lr)).result()
        mine, theirs = (tc.save_weights_and_get_sampling_client().result() for tc in clients)
        prompt, params = types.ModelInput.from_ints(enc("123+456=")), types.SamplingParams(max_tokens=6, seed=3)
        alone = mine.sample(prompt, num_samples=4, sampling_params=params).result()
        out = {}

        def sample(name, sampler):
            out[name] = sampler.sample(prompt, num_samples=4, sampling_params=params).result()

        threads = [threading.Thread(target=sample, args=x) for x in (("op", mine), ("guest", theirs))]
        [t.start() for t in threads]
        [t.join(120) for t in threads]
        assert [s.tokens for s in out["op"].sequences] == [s.tokens for s in alone.sequences]
        assert [s.logprobs for s in out["op"].sequences] == [s.logprobs for s in alone.sequences]
        assert len(out["guest"].sequences) == 4  # the guest gets what its adapter makes of it
        with pytest.raises(tinker.RequestFailedError, match="loss is not finite"):
            clients[1].forward_backward([datum], "cross_entropy").result()
        assert clients[0].forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
    finally:
        for c in (op, guest):
            c.close("success").result()
        next(gen, None)
