"""The Tinker checkpoint API with the real SDK's `RestClient`: training-run records (the cookbook reads
its renderer from them on resume), listing, deletion (gone from disk), TTLs (expired ones swept),
publishing, `weights_info`'s trained roles; and listings of every client's ids refused with a 403
that says why (the SDK retries a 5xx for minutes: a rolling checkpoint used to stall a step)."""

from __future__ import annotations

import json
import time

import pytest

tinker = pytest.importorskip("tinker")

from engine_helpers import tinker_server  # noqa: E402

MODEL = "tiny-moe-chat"
KEY = "tml-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from tinker_server(tmp_path_factory.mktemp("state"), KEY)


@pytest.fixture(scope="module")
def clients(server):
    sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{server.cfg.port}", api_key=KEY)
    yield sc, sc.create_rest_client()
    sc.close("success").result()


def test_runs_and_checkpoints_have_a_local_lifecycle(server, clients):
    sc, rest = clients
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, train_unembed=False,
                                        user_metadata={"renderer_name": "role_colon"})
    a = tc.save_state("a").result().path
    b = tc.save_state("b", ttl_seconds=3600).result().path
    s = tc.save_weights_for_sampler("s").result().path
    run = rest.get_training_run(tc.model_id).result()
    assert run.training_run_id == tc.model_id and run.lora_rank == 4 and run.base_model == MODEL
    assert run.user_metadata == {"renderer_name": "role_colon"}
    assert rest.get_training_run_by_tinker_path(a).result().user_metadata == {"renderer_name": "role_colon"}
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert sorted(c.tinker_path for c in listed) == sorted([a, b, s])
    by_path = {c.tinker_path: c for c in listed}
    assert by_path[a].checkpoint_type == "training" and by_path[s].checkpoint_type == "sampler"
    assert by_path[a].expires_at is None and by_path[b].expires_at is not None and by_path[a].size_bytes > 0
    assert run.last_checkpoint is None or run.last_checkpoint.tinker_path in (a, b)

    info = rest.get_weights_info_by_tinker_path(a).result()
    assert (info.lora_rank, info.train_attn, info.train_mlp, info.train_unembed) == (4, True, True, False)

    rest.publish_checkpoint_from_tinker_path(a).result()
    assert {c.tinker_path: c.public for c in rest.list_checkpoints(tc.model_id).result().checkpoints}[a]
    rest.unpublish_checkpoint_from_tinker_path(a).result()
    assert not {c.tinker_path: c.public for c in rest.list_checkpoints(tc.model_id).result().checkpoints}[a]

    folder = server.service.resolve(b)[2]
    rest.delete_checkpoint_from_tinker_path(b).result()
    assert not folder.exists()  # gone from disk
    folder = server.service.resolve(a)[2]
    rest.set_checkpoint_ttl_from_tinker_path(a, 0).result()
    time.sleep(0.05)
    assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [s]  # a's TTL passed
    assert not folder.exists()
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(a).result()


def test_listing_every_clients_ids_is_refused_with_the_reason(clients):
    _, rest = clients
    for call in (lambda: rest.list_training_runs().result(), lambda: rest.list_user_checkpoints().result()):
        with pytest.raises(tinker.PermissionDeniedError, match="an id is the right to use it"):
            call()


def test_a_checkpoint_past_its_ttl_is_swept(server, clients):
    sc, rest = clients
    tc = sc.create_lora_training_client(base_model=MODEL, rank=2)
    path = tc.save_state("brief", ttl_seconds=0).result().path
    state = server.service.resolve(path)[2] / "state.json"
    assert json.loads(state.read_text())["expires"] <= time.time()
    assert server.tinker.store.sweep() == 1 and not state.parent.exists()


def test_the_training_clients_tokenizer_loads_without_a_hub(server, clients, monkeypatch):
    """`get_tokenizer()` loads what `tokenizer_id` names: the server's own model folder (a bare model
    name sent the SDK to a hub)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sc, _ = clients
    tokenizer = sc.create_lora_training_client(base_model=MODEL, rank=2).get_tokenizer()
    text = "12+30=42"
    assert tokenizer.encode(text, add_special_tokens=False) == server.service.tokenizer.encode(text, add_special_tokens=False)
