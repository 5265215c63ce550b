"""Every public method of the `tinker` SDK's four clients (0.38) against `serve --tinker`: each is
served and checked against a reference value, answered by the client alone, or refused with a 4xx
that says why (never a 404 or 5xx, which the SDK retries for minutes). A method the SDK grows that
nobody decided about fails `test_every_method_is_decided`. An `*_async` twin has its method's answer.
The README's table of the SDK's methods is this file's DECISIONS."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from engine_helpers import tinker_server  # noqa: E402
from tinker import types  # noqa: E402

MODEL, KEY = "tiny-moe-chat", "tml-test-key"
SERVED, CLIENT, REFUSED = "served", "client", "refused"
DECISIONS = {
    "ServiceClient": {
        "close": SERVED,
        "copy_weights": REFUSED,
        "create_custom_loss": SERVED,
        "create_lora_training_client": SERVED,
        "create_rest_client": CLIENT,
        "create_sampling_client": SERVED,
        "create_training_client_from_state": SERVED,
        "create_training_client_from_state_with_optimizer": SERVED,
        "get_console_url": CLIENT,
        "get_server_capabilities": SERVED,
        "get_telemetry": CLIENT,
    },
    "TrainingClient": {
        "create_sampling_client": SERVED,
        "forward": SERVED,
        "forward_backward": SERVED,
        "forward_backward_custom": SERVED,
        "get_console_url": CLIENT,
        "get_info": SERVED,
        "get_telemetry": CLIENT,
        "get_tokenizer": SERVED,
        "load_state": REFUSED,
        "load_state_with_optimizer": REFUSED,
        "optim_step": SERVED,
        "save_state": SERVED,
        "save_weights_and_get_sampling_client": SERVED,
        "save_weights_external": REFUSED,
        "save_weights_for_sampler": SERVED,
    },
    "SamplingClient": {
        "compute_logprobs": SERVED,
        "create": CLIENT,
        "from_sampler_handle": CLIENT,
        "get_base_model": CLIENT,
        "get_sampler_handle": CLIENT,
        "get_telemetry": CLIENT,
        "get_tokenizer": CLIENT,
        "on_queue_state_change": CLIENT,
        "sample": SERVED,
    },
    "RestClient": {
        "assign_session_project": REFUSED,
        "copy_weights": REFUSED,
        "delete_checkpoint": SERVED,
        "delete_checkpoint_from_tinker_path": SERVED,
        "export_session_trace": REFUSED,
        "get_audit_log": REFUSED,
        "get_billing_usage": REFUSED,
        "get_current_checkpoint_storage_usage": REFUSED,
        "get_external_weights_urls": REFUSED,
        "get_sampler": SERVED,
        "get_server_capabilities": SERVED,
        "get_session": SERVED,
        "get_telemetry": CLIENT,
        "get_training_run": SERVED,
        "get_training_run_by_tinker_path": SERVED,
        "get_weights_info_by_tinker_path": SERVED,
        "list_checkpoints": SERVED,
        "list_sessions": REFUSED,
        "list_training_runs": REFUSED,
        "list_user_checkpoints": REFUSED,
        "publish_checkpoint_from_tinker_path": SERVED,
        "search_sessions": REFUSED,
        "set_checkpoint_ttl_from_tinker_path": SERVED,
        "unpublish_checkpoint_from_tinker_path": SERVED,
        "whoami": CLIENT,
    },
}
"""SamplingClient.get_tokenizer resolves the base model's name in the client: it loads with no hub when
the server was started with the model's folder as its name. `create` and `from_sampler_handle` are
constructors the SDK calls itself (the handle is the sampling session id). `whoami` reads a JWT's
claims: with this server's plain API key the SDK says so itself."""


def test_every_method_is_decided():
    for cls_name, decided in DECISIONS.items():
        cls = getattr(tinker, cls_name)
        public = {n for n, v in inspect.getmembers(cls) if not n.startswith("_") and callable(v)}
        undecided = {n for n in public if n.removesuffix("_async") not in decided}
        assert not undecided, f"{cls_name}: no decision for {sorted(undecided)}"
        assert set(decided) <= public, f"{cls_name}: gone from the SDK: {sorted(set(decided) - public)}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from tinker_server(tmp_path_factory.mktemp("state"), KEY)


def datum(tok, text: str, prompt_len: int) -> types.Datum:
    ids = tok.encode(text, add_special_tokens=False)
    weights = [0.0] * (prompt_len - 1) + [1.0] * (len(ids) - prompt_len)
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:], "weights": weights}
    )


def test_the_served_methods_answer_with_reference_values(server):
    import transformers

    tok = server.service.tokenizer
    hf = transformers.AutoModelForCausalLM.from_pretrained(server.service.path, dtype=torch.float32).eval()
    sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{server.cfg.port}", api_key=KEY)
    rest = sc.create_rest_client()
    caps = sc.get_server_capabilities()
    assert caps.supported_models[0].model_name == MODEL and rest.get_server_capabilities().result() == caps
    with pytest.raises(RuntimeError, match="plain API key"):  # the SDK reads it from a JWT; a key has none
        rest.whoami().result()

    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    info = tc.get_info()
    assert info.model_data.model_name == MODEL and info.lora_rank == 4
    assert tc.get_tokenizer().encode("7+8=15", add_special_tokens=False) == tok.encode(
        "7+8=15", add_special_tokens=False
    )
    data = [datum(tok, "12+30=42", 6), datum(tok, "7+8=15", 4)]
    fwd = tc.forward(data, "cross_entropy").result()
    for d, out in zip(data, fwd.loss_fn_outputs, strict=True):  # a fresh adapter adds nothing: the base's logprobs
        ids = torch.tensor([d.model_input.to_ints()])
        want = (
            hf(ids)
            .logits[0]
            .log_softmax(-1)
            .gather(-1, torch.tensor(d.loss_fn_inputs["target_tokens"].tolist())[:, None])[:, 0]
        )
        np.testing.assert_allclose(out["logprobs"].to_numpy(), want.detach().numpy(), atol=1e-5)
    nll = sum(
        -(o["logprobs"].to_numpy() * d.loss_fn_inputs["weights"].to_numpy()).sum()
        for d, o in zip(data, fwd.loss_fn_outputs, strict=True)
    )
    assert tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(nll, rel=1e-5)

    def neg_ll(logprobs, weights):
        loss = -(logprobs * weights).sum()
        return loss, {"custom/neg_ll:sum": loss}

    handle = sc.create_custom_loss(neg_ll, input_ranks={"logprobs": 1, "weights": 1}).result()
    custom = tc.forward_backward_custom(data, handle).result()
    assert custom.metrics["custom/neg_ll:sum"] == pytest.approx(nll, rel=1e-5)
    assert tc.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["grad_norm:mean"] > 0
    after = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()

    state = tc.save_state("step-1").result().path
    weights = tc.save_weights_for_sampler("w-1").result().path
    for clone in (
        sc.create_training_client_from_state(state).result(),
        sc.create_training_client_from_state_with_optimizer(state).result(),
    ):
        np.testing.assert_allclose(
            clone.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy(), after, atol=1e-6
        )
    prompt = types.ModelInput.from_ints(tok.encode("12+30=", add_special_tokens=False))
    greedy = types.SamplingParams(max_tokens=3, temperature=0.0)
    samplers = [
        tc.save_weights_and_get_sampling_client(),
        tc.create_sampling_client(weights).result(),
        sc.create_sampling_client(model_path=weights).result(),
    ]
    outs = [s.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0].tokens for s in samplers]
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) >= 1  # the same revision three ways
    base = sc.create_sampling_client(base_model=MODEL).result()
    lps = base.compute_logprobs(prompt).result()
    ids = torch.tensor([prompt.to_ints()])
    want = hf(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0].detach().numpy()
    assert lps[0] is None and np.allclose(lps[1:], want, atol=1e-5)
    assert base.get_base_model() == MODEL and isinstance(base.get_sampler_handle(), str)

    assert rest.get_sampler(samplers[1]._sampling_session_id).result().base_model == MODEL
    session = rest.get_session(sc.holder.get_session_id()).result()
    assert tc.model_id in session.training_run_ids
    assert rest.get_training_run(tc.model_id).result().lora_rank == 4
    assert rest.get_training_run_by_tinker_path(state).result().training_run_id == tc.model_id
    assert rest.get_weights_info_by_tinker_path(state).result().train_mlp is True
    listed = {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert {state, weights} <= listed
    rest.publish_checkpoint_from_tinker_path(state).result()
    rest.unpublish_checkpoint_from_tinker_path(state).result()
    rest.set_checkpoint_ttl_from_tinker_path(state, 3600).result()
    rest.delete_checkpoint(tc.model_id, "sampler_weights/w-1").result()
    rest.delete_checkpoint_from_tinker_path(state).result()
    assert not rest.list_checkpoints(tc.model_id).result().checkpoints
    sid = sc.holder.get_session_id()
    sc.close("success").result()
    assert sid not in server.service.sessions  # finished: its clients and samplers freed


def test_the_refused_methods_say_why(server, monkeypatch):
    monkeypatch.setenv("TINKER_PROJECT_ID", "p")  # copy_weights names a destination project before it asks
    sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{server.cfg.port}", api_key=KEY)
    rest = sc.create_rest_client()
    tc = sc.create_lora_training_client(base_model=MODEL, rank=2).result()
    state = tc.save_state("s").result().path
    sid = sc.holder.get_session_id()
    calls = {
        "ServiceClient.copy_weights": lambda: sc.copy_weights(state).result(),
        "TrainingClient.load_state": lambda: tc.load_state(state).result(),
        "TrainingClient.load_state_with_optimizer": lambda: tc.load_state_with_optimizer(state).result(),
        "TrainingClient.save_weights_external": lambda: tc.save_weights_external("x").result(),
        "RestClient.assign_session_project": lambda: rest.assign_session_project(sid, "p").result(),
        "RestClient.copy_weights": lambda: rest.copy_weights(state, "p").result(),
        "RestClient.export_session_trace": lambda: rest.export_session_trace(sid).result(),
        "RestClient.get_audit_log": lambda: rest.get_audit_log().result(),
        "RestClient.get_billing_usage": lambda: rest.get_billing_usage("2026-01-01", "2026-02-01").result(),
        "RestClient.get_current_checkpoint_storage_usage": lambda: rest.get_current_checkpoint_storage_usage().result(),
        "RestClient.get_external_weights_urls": lambda: rest.get_external_weights_urls(
            state.replace("/weights/", "/external_weights/")
        ).result(),
        "RestClient.list_sessions": lambda: rest.list_sessions().result(),
        "RestClient.list_training_runs": lambda: rest.list_training_runs().result(),
        "RestClient.list_user_checkpoints": lambda: rest.list_user_checkpoints().result(),
        "RestClient.search_sessions": lambda: rest.search_sessions(types.SessionSearchRequest()).result(),
    }
    assert set(calls) == {f"{c}.{m}" for c, d in DECISIONS.items() for m, v in d.items() if v == REFUSED}
    for name, call in calls.items():
        with pytest.raises(tinker.APIStatusError) as caught:
            call()
        assert caught.value.status_code in (400, 403), (name, caught.value)
        assert len(str(caught.value)) > 40, (name, caught.value)  # a reason, not a bare status
    sc.close("success").result()


def test_the_readme_table_is_the_decisions():

    from docs_pages import TEXT as readme

    for cls, decided in DECISIONS.items():
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{cls}` |"))
        cells = [c.strip() for c in row.split("|")[2:5]]
        for column, kind in zip(cells, (SERVED, CLIENT, REFUSED), strict=True):
            assert set(column.replace("`", "").split(", ")) - {"—"} == {m for m, v in decided.items() if v == kind}, (
                cls,
                kind,
            )
