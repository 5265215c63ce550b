"""The Tinker API around the training calls, with the real SDK: the checkpoint API's local store
(training-run records the cookbook reads its renderer from on resume, listing, deletion gone from
disk, TTLs swept, publishing, `weights_info`'s trained roles; listings of every client's ids
refused with a 403 that says why, where a 404 or 5xx made the SDK retry for minutes), the
tokenizer the SDK loads with no hub, and the sampling scores (top-k, target ids, last n, draws)
against transformers' full softmax."""

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
    tc = sc.create_lora_training_client(
        base_model=MODEL, rank=4, train_unembed=False, user_metadata={"renderer_name": "role_colon"}
    ).result()
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
    tc = sc.create_lora_training_client(base_model=MODEL, rank=2).result()
    path = tc.save_state("brief", ttl_seconds=0).result().path
    state = server.service.resolve(path)[2] / "state.json"
    assert json.loads(state.read_text())["expires"] <= time.time()
    assert server.tinker.store.sweep() == 1 and not state.parent.exists()


def test_the_training_clients_tokenizer_loads_without_a_hub(server, clients, monkeypatch):
    """`get_tokenizer()` loads what `tokenizer_id` names: the server's own model folder (a bare model
    name sent the SDK to a hub)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sc, _ = clients
    tokenizer = sc.create_lora_training_client(base_model=MODEL, rank=2).result().get_tokenizer()
    text = "12+30=42"
    assert tokenizer.encode(text, add_special_tokens=False) == server.service.tokenizer.encode(
        text, add_special_tokens=False
    )


def test_sampling_scores_equal_the_full_softmax_of_transformers(server, clients):
    """Top-k prompt and sample logprobs, target-id logprobs, `prompt_logprobs_last_n` and alternative
    draws, against the full next-token distributions of the same checkpoint in transformers (fp32)."""
    import numpy as np
    import torch
    import transformers
    from tinker import types

    sc, _ = clients
    hf = transformers.AutoModelForCausalLM.from_pretrained(server.service.path, dtype=torch.float32).eval()
    prompt = server.service.tokenizer.encode("123+456=", add_special_tokens=False)
    n = len(prompt)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)  # [N, V]
    targets = np.full((n - 1, 3), -1, dtype=np.int64)
    targets[:, 0], targets[2:, 1] = prompt[1:], 7
    sampler = sc.create_sampling_client(base_model=MODEL).result()
    res = sampler.sample(
        types.ModelInput.from_ints(prompt),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=4, temperature=0.7, seed=5),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=5,
        topk_sample_logprobs=3,
        target_prompt_logprobs=types.TensorData.from_numpy(targets),
        prompt_alt_tokens_k=4,
        prompt_logprobs_last_n=n - 2,
    ).result()
    got = res.prompt_logprobs
    assert got[:2] == [None, None] and np.allclose(
        got[2:], want[1:-1].gather(-1, torch.tensor(prompt[2:])[:, None])[:, 0], atol=1e-5
    )
    topk = res.topk_prompt_logprobs
    assert topk[:2] == [None, None]
    for i in range(2, n):
        values, ids = want[i - 1].topk(5)
        assert [t for t, _ in topk[i]] == ids.tolist() and np.allclose([v for _, v in topk[i]], values, atol=1e-5)
    scored = res.target_prompt_logprobs.to_numpy()
    assert np.allclose(scored[:, 0], want[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0], atol=1e-5)
    assert (
        np.allclose(scored[2:, 1], want[2:-1, 7], atol=1e-5)
        and (scored[:, 2] == 0).all()
        and (scored[:2, 1] == 0).all()
    )
    alt = res.prompt_alt_tokens
    draws, lps = alt.tokens.to_numpy(), alt.logprobs.to_numpy()
    scaled = (hf(torch.tensor([prompt])).logits[0, :-1] / 0.7).log_softmax(-1).detach()
    assert draws.shape == (n - 1, 4) and np.allclose(lps, scaled.gather(-1, torch.tensor(draws)), atol=1e-5)
    for seq in res.sequences:
        full = torch.tensor([prompt + seq.tokens[:-1]])
        dist = (hf(full).logits[0, n - 1 :] / 0.7).log_softmax(-1).detach()  # what each token was drawn from
        values, ids = dist.topk(3)
        assert len(seq.topk_logprobs) == len(seq.tokens)
        for row, v, i in zip(seq.topk_logprobs, values, ids, strict=True):
            assert [t for t, _ in row] == i.tolist() and np.allclose([x for _, x in row], v, atol=1e-5)
        assert np.allclose(seq.logprobs, dist.gather(-1, torch.tensor(seq.tokens)[:, None])[:, 0], atol=1e-4)
    last = sampler.compute_logprobs(types.ModelInput.from_ints(prompt), prompt_logprobs_last_n=2).result()
    assert last[:-2] == [None] * (n - 2) and np.allclose(last[-2:], got[-2:], atol=1e-6)
    sparse = types.TensorData.from_torch_sparse(torch.tensor(targets), pad_value=-1)
    again = (
        sampler.sample(
            types.ModelInput.from_ints(prompt),
            num_samples=1,
            target_prompt_logprobs=sparse,
            sampling_params=types.SamplingParams(max_tokens=1),
        )
        .result()
        .target_prompt_logprobs
    )
    dense = np.zeros((n - 1, 3), np.float32)
    data = again.to_numpy() if again.sparse_crow_indices is None else None
    if data is None:  # only the cells named come back
        crow, col, values = again.sparse_crow_indices, again.sparse_col_indices, np.asarray(again.data)
        for r in range(n - 1):
            dense[r, col[crow[r] : crow[r + 1]]] = values[crow[r] : crow[r + 1]]
        data = dense
    assert np.allclose(data, scored, atol=1e-6)
