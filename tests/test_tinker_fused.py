"""Requests of several Tinker clients sharing one pass: the worker's choice of what may fuse
(never ahead of an earlier request of the same client), and fused forward_backward / sampling
equal to each call alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from trillora.errors import TrilloraError
from trillora.serve.calls import SampleCall
from trillora.serve.config import ServeConfig
from trillora.serve.tinker.service import FwdBwd, TinkerService
from trillora.serve.tinker.wire import Datum
from trillora.serve.worker import Job, Worker


def test_worker_fuses_waiting_requests_of_one_kind_and_keeps_each_clients_order():
    ran: list = []
    gate = threading.Event()
    done = threading.Semaphore(0)

    def fuser(payloads):
        ran.append(("fused", tuple(payloads)))
        return list(payloads)

    worker = Worker({"fb": fuser, "sample": fuser})

    def job(name, model=None, fuse=None):
        def run():
            ran.append(("alone", name))
            return name

        return Job(run, lambda out: done.release(), model, fuse, name)

    worker.submit(Job(gate.wait, lambda out: done.release()))  # holds the worker while the rest queue up
    for name, model, seq, fuse in [
        ("fbA1", "A", 1, "fb"),
        ("fbB1", "B", 1, "fb"),
        ("optA2", "A", 2, None),
        ("fbA3", "A", 3, "fb"),
        ("fbC1", "C", 1, "fb"),
        ("s1", None, None, "sample"),
        ("s2", None, None, "sample"),
    ]:
        worker.submit(job(name, model, fuse), seq)
    gate.set()
    for _ in range(8):
        assert done.acquire(timeout=10)
    ran = [r for r in ran if r[1] != "gate"]
    # fbA3 waits behind optA2 (same client); fbC1 is not held back by A's optimizer step
    assert ran == [("fused", ("fbA1", "fbB1", "fbC1")), ("alone", "optA2"), ("alone", "fbA3"), ("fused", ("s1", "s2"))]
    assert worker.fused_batches == 2


def test_a_client_behind_a_busy_one_waits_only_for_the_passes_before_it():
    """The scheduling guarantee (`--max-call-tokens` bounds each call): a request runs once the
    passes holding the requests that arrived before it are done; a pass may carry up to
    `max_fused` - 1 later requests of its kind along, never more. So a client sending one call
    behind a client that never stops sending is served after two of its passes here, not after all."""
    ran: list = []
    gate, done = threading.Event(), threading.Semaphore(0)
    worker = Worker({"fb": lambda payloads: (ran.append(tuple(payloads)), list(payloads))[1]}, max_fused=2)
    worker.submit(Job(gate.wait, lambda out: done.release()))  # holds the worker while the rest queue up
    arrivals = [
        ("A1", "A", 1, "fb"),
        ("A2", "A", 2, "fb"),
        ("B1", "B", 1, None),
        ("A3", "A", 3, "fb"),
        ("A4", "A", 4, "fb"),
        ("A5", "A", 5, "fb"),
        ("A6", "A", 6, "fb"),
    ]
    for name, model, seq, fuse in arrivals:
        worker.submit(Job(lambda name=name: ran.append((name,)), lambda out: done.release(), model, fuse, name), seq)
    gate.set()
    for _ in range(len(arrivals) + 1):
        assert done.acquire(timeout=10)
    assert ran == [("A1", "A2"), ("B1",), ("A3", "A4"), ("A5", "A6")]


def test_keys_take_turns_and_a_clients_order_holds_across_keys():
    """20,000 one-token samples of one key held another key's completion 427 s: the queue was one
    line. Keys now take turns: the other key's request runs after one of the busy key's, and a
    client whose requests come under two keys still runs them in its order."""
    ran: list = []
    gate, done = threading.Event(), threading.Semaphore(0)
    worker = Worker()
    worker.submit(Job(gate.wait, lambda out: done.release()))  # holds the worker while the rest queue up
    arrivals = [(f"a{i}", "busy", None, None) for i in range(5)] + [("b", "other", None, None)]
    arrivals += [("c1", "busy", "C", 1), ("c2", "other", "C", 2), ("d", "third", None, None)]
    for name, owner, model, seq in arrivals:
        worker.submit(Job(lambda name=name: ran.append(name), lambda out: done.release(), model, owner=owner), seq)
    gate.set()
    for _ in range(len(arrivals) + 1):
        assert done.acquire(timeout=10)
    # a0 (the oldest), then the keys not yet served, oldest first; then in turns: "other"'s c2 must wait
    # for C's c1, which runs in its place
    assert ran == ["a0", "b", "d", "a1", "c1", "c2", "a2", "a3", "a4"], ran


def test_a_pass_fuses_one_keys_calls_and_a_key_waits_on_the_worker_a_bounded_number_of_times():
    """A pass that took another key's calls along let a flood of big calls hold a key 62.8 s (about
    ten of them); and calls answered at once (`Futures.now`) held every threadpool thread 93.5 s."""
    from trillora.serve.calls import BadRequest
    from trillora.serve.tinker.futures import MAX_WAITING, Futures

    ran: list = []
    gate, done = threading.Event(), threading.Semaphore(0)
    worker = Worker({"fb": lambda payloads: (ran.append(tuple(payloads)), list(payloads))[1]})
    worker.submit(Job(gate.wait, lambda out: done.release()))
    for name, owner in (("a1", "A"), ("b1", "B"), ("a2", "A")):
        worker.submit(
            Job(lambda name=name: ran.append((name,)), lambda out: done.release(), None, "fb", name, owner=owner)
        )
    futures = Futures(worker, poll_seconds=1.0)
    waiting = [threading.Thread(target=futures.now, args=(lambda: None, "A")) for _ in range(MAX_WAITING)]
    [t.start() for t in waiting]
    while futures.waiting["A"] < MAX_WAITING:
        threading.Event().wait(0.01)
    with pytest.raises(BadRequest, match="calls waiting on the worker") as refused:
        futures.now(lambda: None, "A")
    assert refused.value.status == 429
    gate.set()
    [t.join(10) for t in waiting]
    for _ in range(4):
        assert done.acquire(timeout=10)
    assert ran == [("a1", "a2"), ("b1",)], ran
    assert futures.now(lambda: "ok", "A") == "ok" and futures.waiting["A"] == 0


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return TinkerService(ServeConfig(model="tiny-moe-chat", state_dir=str(tmp_path_factory.mktemp("state"))))


def datum(service, text: str, prompt_len: int, **extra) -> Datum:
    ids = service.tokenizer.encode(text, add_special_tokens=False)
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


def call(service, model_id, data, loss_fn="cross_entropy", forward_only=False) -> FwdBwd:
    return FwdBwd(model_id, loss_fn, {}, data, service.check_data(loss_fn, {}, data), forward_only)


def grads(service, model_id):
    adapter = service.client(model_id).adapter
    out = {k: p.grad.clone() for k, p in adapter.params.items() if p.grad is not None}
    adapter.optimizer = None
    for p in adapter.params.values():
        p.grad = None
    return out


def test_forward_backward_of_several_clients_in_one_pass_equals_each_alone(service):
    sid = service.create_session()
    a = service.create_model(sid, 1, 4, ("attention", "mlp", "shared_experts", "experts", "lm_head"), 1)["model_id"]
    b = service.create_model(sid, 2, 2, ("mlp", "shared_experts", "experts"), 2)["model_id"]
    for m in (a, b):
        with torch.no_grad():
            for p in service.client(m).adapter.params.values():
                p.normal_(0.0, 0.05)
    calls = [
        call(service, a, [datum(service, "123+456=579", 5)]),
        call(service, b, [datum(service, "7+8=15", 3), datum(service, "999+1=1000", 5)]),
        call(service, a, [datum(service, "40+2=42", 4)], forward_only=True),
        call(service, a, [datum(service, "12+30=42", 4, advantages=0.5, logprobs=-2.0)], "importance_sampling"),
    ]
    alone = []
    for c in calls:
        alone.append(service.forward_backward_many([c])[0])
    want_a, want_b = grads(service, a), grads(service, b)
    fused = service.forward_backward_many(calls)
    got_a, got_b = grads(service, a), grads(service, b)
    for (lp1, m1), (lp2, m2) in zip(alone, fused, strict=True):
        assert m1["loss:sum"] == pytest.approx(m2["loss:sum"], rel=1e-5, abs=1e-6)
        for x, y in zip(lp1, lp2, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)  # fp32 sums reordered; logprobs reach -20
    assert want_a.keys() == got_a.keys() and want_b.keys() == got_b.keys() and want_a.keys() != want_b.keys()
    for want, got in ((want_a, got_a), (want_b, got_b)):
        for k in want:
            assert (got[k] - want[k]).abs().max() <= 5e-5 * max(1.0, float(want[k].abs().max())), (
                k
            )  # fp32 sums reordered


def test_samples_of_several_samplers_in_one_generate_equal_each_alone(service):
    sid = service.create_session()
    m = service.create_model(sid, 1, 4, ("attention", "mlp", "shared_experts", "experts", "lm_head"), 3)["model_id"]
    with torch.no_grad():
        for p in service.client(m).adapter.params.values():
            p.normal_(0.0, 0.2)
    tuned = service.save_for_sampler(m, None, sid, 1)["sampling_session_id"]
    base = service.create_sampler(sid, 2, None, None)
    greedy = {"max_tokens": 5, "temperature": 0.0}
    prompts = [service.tokenizer.encode(t, add_special_tokens=False) for t in ("12+34=", "500+500=", "9+9=")]
    calls = [
        SampleCall(tuned, prompts[0], 2, greedy),
        SampleCall(base, prompts[1], 2, greedy),
        SampleCall(tuned, prompts[2], 2, greedy),
        SampleCall(base, [], 2, greedy),
    ]  # the last one is refused
    alone = [service.sample_many([c])[0] for c in calls]
    fused = service.sample_many(calls)
    assert isinstance(fused[3], Exception) and "non-empty" in str(fused[3])
    for (want, *_), (got, *_) in zip(alone[:3], fused[:3], strict=True):
        for (t1, lp1, r1), (t2, lp2, r2) in zip(want, got, strict=True):
            assert t1 == t2 and r1 == r2
            # fp32 sums in another order (batches of other sizes; adapters drawn at std 0.2 make logits
            # large): 2.3e-5 seen on a -0.80 logprob; a row with the wrong adapter moves by O(0.1)
            np.testing.assert_allclose(lp1, lp2, atol=1e-5, rtol=1e-4)
    assert alone[0][0][0][0] != service.sample_many([SampleCall(base, prompts[0], 1, greedy)])[0][0][0][0]


def test_fusing_settings_are_checked_where_they_are_given():
    import subprocess
    import sys

    with pytest.raises(TrilloraError, match="max_fused=0; allowed: an integer >= 1"):
        ServeConfig(model="tiny-moe-chat", max_fused=0)
    with pytest.raises(TrilloraError, match="gather_seconds=-1"):
        ServeConfig(model="tiny-moe-chat", gather_seconds=-1)
    for count in ("max_rank", "max_samples", "max_clients", "max_connections", "max_futures", "max_unread_mib"):
        for bad in (0, 1.5, True):  # every count the server keeps is a whole number >= 1
            with pytest.raises(TrilloraError, match=f"{count}={bad!r}; allowed: an integer >= 1"):
                ServeConfig(model="tiny-moe-chat", **{count: bad})
    out = subprocess.run(
        [sys.executable, "-m", "trillora", "serve", "tiny-moe-chat", "--tinker", "--max-fused", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "max_fused=0; allowed" in out.stderr and "Traceback" not in out.stderr


def test_adapter_gemms_keep_the_adapters_precision_on_cpu():
    """bf16 activations on CPU: the adapter's grouped GEMMs stay fp32 (CPU bf16 kernels are slow and
    lose precision); only on CUDA do they follow bf16 activations."""
    from trillora.models.moe import compute_dtype

    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert compute_dtype(x, torch.zeros(2, 8, 8)) == torch.float32
    assert compute_dtype(x.float(), torch.zeros(2, 8, 8)) == torch.float32


@pytest.mark.slow
def test_the_fused_adapters_benchmark_runs_on_expert_parallel_ranks(tmp_path):
    """`benchmarks/fused_adapters.py --ep 2` (the README row's command, smaller): fused passes on two
    expert-parallel ranks, checked against one pass per adapter before timing."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "fused_adapters.py"
    out = tmp_path / "ep2.json"
    run = subprocess.run(
        [
            sys.executable,
            str(script),
            "--ep",
            "2",
            "--adapters",
            "2",
            "--rows",
            "4",
            "--samples",
            "2",
            "--max-tokens",
            "4",
            "--reps",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["expert_parallel_ranks"] == 2 and set(r["speedup_one_pass"]) == {"forward_backward", "sample"}
    assert r["check"]["max_logprob_diff"] < 1e-4 and r["check"]["max_grad_rel_diff"] < 1e-4


def test_expert_rank_rule_gives_each_client_rank_over_top_k_expert_adapters(tmp_path):
    """`serve --tinker --expert-rank-rule divide_by_top_k`: a rank-4 client's routed-expert adapters
    are rank 2 on tiny-moe-chat (top-2 routing), dense ones rank 4. Its sampler scores the prompt as
    forward does; a pass shared with another client equals each alone; the saved state (with the
    expert rank) resumes bit for bit; an unknown rule is refused by name."""
    svc = TinkerService(ServeConfig(model="tiny-moe-chat", state_dir=str(tmp_path), expert_rank_rule="divide_by_top_k"))
    sid = svc.create_session()
    a = svc.create_model(sid, 1, 4, ("attention", "mlp", "shared_experts", "experts", "lm_head"), 1)["model_id"]
    b = svc.create_model(sid, 2, 8, ("mlp", "shared_experts", "experts"), 2)["model_id"]
    params = svc.client(a).adapter.params
    expert = next(k for k in params if k.endswith("experts.lora_gate_A"))
    dense = next(k for k in params if k.endswith("q_proj.lora_A"))
    assert params[expert].shape[1] == 2 and params[dense].shape[0] == 4
    assert svc.client(b).adapter.params[expert].shape[1] == 4  # rank 8 // top-2
    data = [datum(svc, "123+456=579", 5), datum(svc, "7+8=15", 3)]
    for m in (a, b):  # B non-zero
        svc.forward_backward(m, "cross_entropy", {}, data, svc.check_data("cross_entropy", {}, data), False)
        svc.optim_step(m, {"learning_rate": 5e-2})
    calls = [call(svc, a, data[:1]), call(svc, b, data[1:])]
    alone = [svc.forward_backward_many([c])[0] for c in calls]
    want_a, want_b = grads(svc, a), grads(svc, b)
    fused = svc.forward_backward_many(calls)
    got_a, got_b = grads(svc, a), grads(svc, b)
    for (lp1, _), (lp2, _) in zip(alone, fused, strict=True):
        np.testing.assert_allclose(lp1[0], lp2[0], atol=1e-5, rtol=1e-5)
    for want, got in ((want_a, got_a), (want_b, got_b)):
        for k in want:
            assert (got[k] - want[k]).abs().max() <= 5e-5 * max(1.0, float(want[k].abs().max())), k
    sampler = svc.save_for_sampler(a, None, sid, 3)["sampling_session_id"]
    prompt = data[0].tokens
    _, scored, _ = svc.sample(sampler, prompt, 1, {"max_tokens": 1}, True)
    forward = svc.forward_backward(
        a,
        "cross_entropy",
        {},
        [datum(svc, "123+456=579", 5)],
        svc.check_data("cross_entropy", {}, [datum(svc, "123+456=579", 5)]),
        True,
    )[0][0]
    np.testing.assert_allclose(scored[1:], forward[: len(prompt) - 1], atol=1e-4)
    svc.optim_step(a, {"learning_rate": 5e-2})  # moments to save
    path = svc.save_state(a, "divided")["path"]
    resumed = svc.load_state(sid, 4, path, True)["model_id"]
    again = svc.client(resumed).adapter
    assert again.config.expert_rank == 2 and again.params[expert].shape[1] == 2
    assert all(torch.equal(again.params[k], p) for k, p in svc.client(a).adapter.params.items())
    with pytest.raises(TrilloraError, match="expert_rank_rule='half'; allowed: same, divide_by_top_k"):
        ServeConfig(model="tiny-moe-chat", expert_rank_rule="half")
