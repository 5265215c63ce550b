"""One saved adapter state across the faces: a `trillora train` checkpoint opens as a Tinker
training client with the trainer's logprobs, and that client's saved state resumes the run to the
same next step, bit for bit, as the uninterrupted run took."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import SMALL_RUN
from safetensors.torch import load_file

from trillora.config import load_config
from trillora.errors import ConfigError
from trillora.policy.logprobs import token_logprobs
from trillora.serve.calls import BadRequest
from trillora.serve.config import ServeConfig
from trillora.serve.tinker.service import FwdBwd, TinkerService
from trillora.serve.tinker.wire import Datum
from trillora.trainer import Trainer

pytestmark = pytest.mark.slow  # trains runs and starts services


def _config(out, name: str, *overrides: str):
    return load_config(None, [f"out_dir={out}", f"name={name}", *SMALL_RUN, "checkpoint.every=1", *overrides])


def _rows(run) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.endswith("_seconds")} for r in rows}


def test_a_run_checkpoint_is_a_tinker_client_whose_saved_state_resumes_the_run(tmp_path):
    state_dir, runs = tmp_path / "state", tmp_path / "state" / "runs"
    Trainer(_config(runs, "r")).run()  # steps 1 and 2, a checkpoint after each
    step1 = runs / "r" / "checkpoints" / "step-000001"

    service = TinkerService(ServeConfig(model="tiny-moe", state_dir=str(state_dir)))
    sid = service.create_session()
    model_id = service.load_state(sid, 0, "tinker://runs/r/checkpoints/step-000001", optimizer=True)["model_id"]
    assert service.client(model_id).adapter.steps == 1  # one AdamW step: one RL step of one minibatch

    # the client's logprobs are the trainer's own, with the same adapter, on the trainer's encoding
    ids = service.tokenizer("12+34=46", return_tensors=None)["input_ids"]
    data = [Datum(ids[:-1], {"target_tokens": np.array(ids[1:]), "weights": np.ones(len(ids) - 1, np.float32)})]
    call = FwdBwd(model_id, "cross_entropy", {}, data, service.check_data("cross_entropy", {}, data), True)
    served, _ = service.forward_backward_many([call])[0]
    trainer = Trainer(_config(tmp_path / "oracle", "o"))
    trainer.policy.load(load_file(str(step1 / "rank-0.safetensors")), step1)
    with torch.no_grad():
        oracle = token_logprobs(trainer.model, torch.tensor([ids]))[0][0]
    np.testing.assert_allclose(served[0], oracle.numpy(), rtol=0, atol=1e-5)

    # its saved state (adapter, AdamW moments, steps) resumes the run: step 2 as the run took it
    service.save_state(model_id, "s1")
    saved = state_dir / model_id.replace(":", "_") / "weights" / "s1"
    Trainer(_config(tmp_path / "again", "r2", f"checkpoint.resume_from={saved}")).run()
    first, second = _rows(runs / "r"), _rows(tmp_path / "again" / "r2")
    assert sorted(second) == [1, 2] and second[2].pop("resumed_from") == 1  # the plots mark where it began
    # every figure of the step the same; the FLOPs counted so far are this run's own (from its start)
    assert second[2].pop("flops_total") < first[2].pop("flops_total")
    assert second[2] == first[2]
    mine = load_file(str(tmp_path / "again" / "r2" / "checkpoints" / "step-000002" / "rank-0.safetensors"))
    theirs = load_file(str(runs / "r" / "checkpoints" / "step-000002" / "rank-0.safetensors"))
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine if k != "rng.torch")


def test_a_state_the_slots_or_the_run_cannot_hold_is_refused_by_name(tmp_path):
    state_dir, runs = tmp_path / "state", tmp_path / "state" / "runs"
    Trainer(_config(runs, "a32", "steps=1", "lora.alpha=32")).run()
    service = TinkerService(ServeConfig(model="tiny-moe", state_dir=str(state_dir)))
    sid = service.create_session()
    with pytest.raises(BadRequest, match="alpha 32.0; this server's adapters use 16.0"):
        service.load_state(sid, 0, "tinker://runs/a32/checkpoints/step-000001", optimizer=True)
    with pytest.raises(BadRequest, match="no saved weights") as e:
        service.load_state(sid, 0, "tinker://runs/a32/checkpoints/step-000009", optimizer=True)
    assert e.value.status == 404
    with pytest.raises(BadRequest, match="run name"):
        service.load_state(sid, 0, "tinker://runs/../checkpoints/step-000001", optimizer=True)

    folder = runs / "a32" / "checkpoints" / "step-000001"
    (folder / "adapter.safetensors").write_bytes(b"planted")  # read as a run's checkpoint whatever else lies there
    ok = TinkerService(ServeConfig(model="tiny-moe", state_dir=str(state_dir), lora_alpha=32.0))
    ok.load_state(ok.create_session(), 0, "tinker://runs/a32/checkpoints/step-000001", optimizer=True)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "../../x": manifest["state.json"]}))
    with pytest.raises(BadRequest, match="outside the checkpoint") as e:
        ok.load_state(ok.create_session(), 0, "tinker://runs/a32/checkpoints/step-000001", optimizer=True)
    assert e.value.status == 400 and str(state_dir) not in str(e.value)  # no server path in the answer
    (folder / "manifest.json").write_text(json.dumps(manifest))
    state = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps({**state, "layout": {"world": 2}}))
    with pytest.raises(BadRequest, match="written by a torchrun layout"):
        ok.load_state(ok.create_session(), 0, "tinker://runs/a32/checkpoints/step-000001", optimizer=True)
    (folder / "state.json").write_text(json.dumps(state))
    client = ok.load_state(ok.create_session(), 0, "tinker://runs/a32/checkpoints/step-000001", True)["model_id"]
    ok.save_for_sampler(client, "w")
    weights = state_dir / client.replace(":", "_") / "sampler_weights" / "w"
    with pytest.raises(ConfigError, match="holds no AdamW state"):
        Trainer(_config(tmp_path / "d", "d", "lora.alpha=32", f"checkpoint.resume_from={weights}")).run()
    with pytest.raises(
        ConfigError, match=r"this run's \[lora\] is \(8, 8, \['experts', 'mlp', 'shared_experts'\], 16.0"
    ):
        Trainer(_config(tmp_path / "b", "b", f"checkpoint.resume_from={folder}")).run()
    with pytest.raises(ConfigError, match="no saved state there"):
        Trainer(_config(tmp_path / "c", "c", f"checkpoint.resume_from={tmp_path / 'nowhere'}")).run()


def test_the_tinker_sdk_opens_a_run_checkpoint_with_the_operators_key_only(tmp_path):
    """Through the real SDK and HTTP: the operator's key makes a training client and a sampler of a
    run's checkpoint (their logprobs the trainer's), another key is refused with 403 naming why."""
    tinker = pytest.importorskip("tinker")
    from engine_helpers import running_server

    state_dir = tmp_path / "state"
    Trainer(_config(state_dir / "runs", "r", "steps=1")).run()
    step1 = state_dir / "runs" / "r" / "checkpoints" / "step-000001"
    trainer = Trainer(_config(tmp_path / "oracle", "o"))
    trainer.policy.load(load_file(str(step1 / "rank-0.safetensors")), step1)

    cfg = ServeConfig(
        model="tiny-moe", tinker=True, port=0, api_key=["tml-operator", "tml-other"], state_dir=str(state_dir)
    )
    for server in running_server(cfg):
        url, path = f"http://127.0.0.1:{server.cfg.port}", "tinker://runs/r/checkpoints/step-000001"
        other = tinker.ServiceClient(base_url=url, api_key="tml-other")
        with pytest.raises(Exception, match="needs the operator's key"):
            other.create_training_client_from_state_with_optimizer(path).result()
        with pytest.raises(Exception, match="needs the operator's key"):
            other.create_sampling_client(model_path=path).result()
        other.close("success").result()
        sc = tinker.ServiceClient(base_url=url, api_key="tml-operator")
        tc = sc.create_training_client_from_state_with_optimizer(path).result()
        ids = server.service.tokenizer("12+34=46")["input_ids"]
        datum = tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
        )
        served = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        sampler = sc.create_sampling_client(model_path=path).result()  # the checkpoint as a sampler, too
        sampled = sampler.compute_logprobs(tinker.types.ModelInput.from_ints(ids)).result()[1:]
        info = tinker.RestClient(base_url=url, api_key="tml-operator").get_weights_info_by_tinker_path(path).result()
        sc.close("success").result()
    with torch.no_grad():
        oracle = token_logprobs(trainer.model, torch.tensor([ids]))[0][0]
    np.testing.assert_allclose(np.array(served), oracle.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.array(sampled), oracle.numpy(), rtol=0, atol=1e-5)
    assert (info.lora_rank, info.train_attn, info.train_mlp) == (8, False, True)
