"""Calls of two clients in ONE pass on a sharded Tinker service (gloo ranks, each with its own
datums of each call, one with none of a call's; every layout in LAYOUTS: ep, tp, pp with chunks,
cp, sp, a vocabulary-parallel head, FSDP): outcomes, gradient norms, saved adapters and greedy
samples of both clients' revisions in one `generate` equal to one process running each call
alone. Every routed row's adapter travels with it to its expert's rank
(`parallel.expert_parallel`), and every rank numbers the pass's adapters alike. Also: a
tensor-parallel rank splits the base before allocating it and reads only its chunks."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from engine_helpers import serve_config, serve_layout
from gloo_ranks import run_ranks
from safetensors.torch import load_file

from trillora.models.transformer import DecoderLayer
from trillora.serve.calls import SampleCall
from trillora.serve.config import ServeConfig
from trillora.serve.tinker.service import FwdBwd, TinkerService
from trillora.serve.tinker.wire import Datum

pytestmark = pytest.mark.slow  # spawned multi-rank services

MODEL = "tiny-moe-chat"
EVERY_ROLE = ("attention", "mlp", "shared_experts", "experts", "lm_head")


def datum(tokenizer, text: str, prompt_len: int, **extra) -> Datum:
    ids = tokenizer.encode(text, add_special_tokens=False)
    n = len(ids) - 1
    weights = np.array([0.0] * (prompt_len - 1) + [1.0] * (n - prompt_len + 1), dtype=np.float32)
    return Datum(
        ids[:-1],
        {
            "target_tokens": np.array(ids[1:]),
            "weights": weights,
            **{k: np.full(n, v, np.float32) for k, v in extra.items()},
        },
    )


def scenario(service, out: dict) -> dict:
    """Two clients; their calls in one `forward_backward_many` (or one by one, `out["alone"]`), a
    step each, the calls again; then saved states."""
    sid = service.create_session()
    a = service.create_model(sid, 1, 4, EVERY_ROLE, 1)["model_id"]
    b = service.create_model(sid, 2, 2, ("mlp", "shared_experts", "experts"), 2)["model_id"]
    tok = service.tokenizer

    def call(model_id, data, loss_fn="cross_entropy", forward_only=False):
        return FwdBwd(model_id, loss_fn, {}, data, service.check_data(loss_fn, {}, data), forward_only)

    calls = [
        call(a, [datum(tok, "123+456=579", 5)]),  # one datum: the second dp rank has none of it
        call(b, [datum(tok, "7+8=15", 3), datum(tok, "999+1=1000", 5), datum(tok, "5+5=10", 3)]),
        call(b, [datum(tok, f"{x}+{x}={2 * x}", 3) for x in (11, 23, 40, 7)]),  # 2 per dp rank: chunks under ep
        call(a, [datum(tok, "40+2=42", 4)], forward_only=True),
        call(a, [datum(tok, "12+30=42", 4, advantages=0.5, logprobs=-2.0)], "importance_sampling"),
    ]
    results, norms = [], []
    for _ in range(2):
        if out["alone"]:
            results += [service.forward_backward_many([c])[0] for c in calls]
        else:
            results += service.forward_backward_many(calls)
        for m in (a, b):
            norms.append(service.optim_step(m, {"learning_rate": 2e-2})["metrics"]["grad_norm:mean"])
    paths = [service.save_state(m, "after")["path"] for m in (a, b)]
    samplers = [service.save_for_sampler(m, None, sid, seq)["sampling_session_id"] for seq, m in ((3, a), (4, b))]
    greedy = {"max_tokens": 5, "temperature": 0.0}
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("12+34=", "500+500=", "9+9=")]
    sampling = [
        SampleCall(samplers[0], prompts[0], 2, greedy),
        SampleCall(samplers[1], prompts[1], 2, greedy),
        SampleCall(samplers[0], prompts[2], 1, greedy),
    ]
    # together, the first two share one generate, each prompt with its client's revision
    samples = [service.sample_many([c])[0] for c in sampling] if out["alone"] else service.sample_many(sampling)
    return {"results": results, "norms": norms, "paths": paths, "samples": samples}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_of(root: str, path: str) -> dict:
    model_id = path.split("://", 1)[1].split("/")[0]
    return load_file(os.path.join(root, model_id.replace(":", "_"), "weights", "after", "adapter.safetensors"))


def worker(rank: int, world: int, flags: dict, root: str) -> None:
    service = TinkerService(serve_config(model=MODEL, state_dir=os.path.join(root, "sharded"), **flags))
    if flags.get("fsdp"):  # the base's layers sharded over the data-parallel ranks (and cp)
        norm = next(m for m in service.base.model.modules() if isinstance(m, DecoderLayer)).input_layernorm.weight
        assert norm.to_local().shape[0] < norm.shape[0], norm.placements
    if flags == {"fsdp": True}:  # what this rank holds of the base is what the planner counts for it
        from trillora.plan.clusters import CLUSTERS
        from trillora.plan.planner import plan_service

        held = sum(_local(p).numel() for n, p in service.base.model.named_parameters() if ".lora_" not in n)
        planned = next(
            x
            for x in plan_service(service.base.model.args, 2, CLUSTERS["cpu"], 2, 8, 64, 4, base_bytes=4)
            if x.layout.fsdp and x.layout.ep == 1 and x.layout.cp == 1
        )
        assert held == pytest.approx(planned.estimate.memory["base weights"] / 4, rel=1e-3)
    seen = set()  # under sp: what the final norm receives, a sequence shard
    service.base.model.model.norm.register_forward_pre_hook(
        lambda m, args: seen.add(str(getattr(args[0], "placements", "")))
    )
    if rank > 0:
        service.follow()
        assert not flags.get("sp") or seen == {"(Shard(dim=1),)"}, seen
        return
    try:  # with microbatches the shared pass runs in chunks, each chunk's rows with their adapters
        got = scenario(service, {"alone": False})
    finally:
        service.stop()
    assert not flags.get("sp") or seen == {"(Shard(dim=1),)"}, seen
    rule = flags.get("expert_rank_rule", "same")
    want = scenario(
        TinkerService(ServeConfig(model=MODEL, state_dir=os.path.join(root, "one"), expert_rank_rule=rule), alone=True),
        {"alone": True},
    )
    for (lp1, m1), (lp2, m2) in zip(want["results"], got["results"], strict=True):
        assert m2["loss:sum"] == pytest.approx(m1["loss:sum"], rel=1e-5, abs=1e-6)
        for x, y in zip(lp1, lp2, strict=True):
            np.testing.assert_allclose(y, x, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got["norms"], want["norms"], rtol=1e-5)
    assert min(want["norms"]) > 0
    for (want_seqs, *_), (got_seqs, *_) in zip(want["samples"], got["samples"], strict=True):
        for (t1, lp1, r1), (t2, lp2, r2) in zip(want_seqs, got_seqs, strict=True):
            assert t1 == t2 and r1 == r2
            np.testing.assert_allclose(lp2, lp1, atol=5e-5)
    assert got["samples"][0][0][0][0] != got["samples"][1][0][0][0]  # other prompt, other revision
    for p_got, p_want in zip(got["paths"], want["paths"], strict=True):
        mine, one = state_of(os.path.join(root, "sharded"), p_got), state_of(os.path.join(root, "one"), p_want)
        assert set(mine) == set(one)
        for k, t in one.items():
            if k != "rng.torch":
                torch.testing.assert_close(mine[k], t, atol=5e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


LAYOUTS = {  # id: (ranks, service flags)
    "ep2-divided-expert-rank": (2, {"ep": 2, "expert_rank_rule": "divide_by_top_k"}),
    "pp2-ep2-microbatches2-ac": (4, {"ep": 2, "pp": 2, "pp_microbatches": 2, "activation_checkpoint_every": 1}),
    "tp2-ep2": (4, {"tp": 2, "ep": 2}),
    "pp2-tp2": (4, {"tp": 2, "pp": 2}),
    "tp2-cp2-sp-vocab-parallel": (4, {"tp": 2, "cp": 2, "sp": True, "vocab_parallel": True}),
    "pp2-cp2-microbatches3": (4, {"pp": 2, "cp": 2, "pp_microbatches": 3}),
    "fsdp2": (2, {"fsdp": True}),
    "fsdp4-ep2": (4, {"fsdp": True, "ep": 2}),  # experts sharded over their 2 replicas
    "fsdp2-tp2": (4, {"fsdp": True, "tp": 2}),  # 2-D parameters
    "fsdp2-pp2-microbatches2-ac": (4, {"fsdp": True, "pp": 2, "pp_microbatches": 2, "activation_checkpoint_every": 1}),
    "fsdp-cp2-ep2": (4, {"fsdp": True, "cp": 2, "ep": 2}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_clients_in_one_pass_on_expert_parallel_ranks_equal_each_call_alone(tmp_path, layout):
    world, flags = LAYOUTS[layout]
    run_ranks(worker, world, flags, str(tmp_path))


def tp_worker(rank: int, world: int, root: str) -> None:
    """Each tp rank splits the base on the meta device and reads only its part of every tensor."""
    from torch.distributed.tensor import DTensor

    import trillora
    from trillora.parallel import tensor_parallel

    split_on, real = [], tensor_parallel.distribute_tensor

    def spy(t, *args, **kwargs):
        split_on.append(t.device.type)
        return real(t, *args, **kwargs)

    tensor_parallel.distribute_tensor = spy
    service = TinkerService(ServeConfig(model=MODEL, state_dir=root, parallel=serve_layout(tp=2)))
    tensor_parallel.distribute_tensor = real
    assert split_on and set(split_on) == {"meta"}  # split before anything whole was allocated
    whole = dict(trillora.load_model(MODEL).named_parameters())
    parts = {n: p for n, p in service.base.model.named_parameters() if isinstance(p, DTensor) and ".lora_" not in n}
    assert any(".q_proj." in n for n in parts) and any(".o_proj." in n for n in parts)
    for n, p in parts.items():
        dim = p.placements[0].dim if p.placements[0].is_shard() else None
        want = whole[n] if dim is None else whole[n].chunk(2, dim)[rank]
        assert torch.equal(p.to_local(), want), n


def test_a_tensor_parallel_rank_reads_only_its_part_of_each_layer(tmp_path):
    run_ranks(tp_worker, 2, str(tmp_path))
