"""A learning server on a sharded base under torchrun's layouts (gloo ranks): every rank runs the
learner's round on rank 0's experience (`TinkerService.learn`), the revision it writes equals one
process's on the same traces (every adapter tensor to 1e-6), and every rank serves it (a greedy
sample through the sharded service equals one process's).

AdamW's first step is lr · g / (|g| + eps): for a gradient element near eps it turns the rounding
of another summation order (tp's partial sums, the dp all-reduce) into lr / eps times as much. The
config's eps = 1e-4 keeps that factor at 10 at the default lr (1e-3); with the default eps (1e-8)
a 1e-9 difference in a 1e-6 gradient moves a weight by 1e-4 (measured: 6e-6 at eps 1e-6, lr 2e-3;
3e-7 here, the gradients themselves differing by at most 3e-7 of 0.1)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from engine_helpers import free_port, post_json, serve_config, wait_for_health
from gloo_ranks import run_ranks
from safetensors.torch import load_file

from trillora.cli.commands import follow_learning
from trillora.config import load_config
from trillora.errors import ConfigError
from trillora.policy.adapters import Revision
from trillora.policy.logprobs import token_logprobs
from trillora.serve.calls import SampleCall
from trillora.serve.config import ServeConfig
from trillora.serve.registry import SERVED
from trillora.serve.tinker.service import TinkerService
from trillora.traces import Call, Feedback, TraceStore
from trillora.trainer.learner import Learner

pytestmark = pytest.mark.slow  # spawned multi-rank services

MODEL = "tiny-moe-chat"
LEARN = """seed = 0
[lora]
rank = 4
targets = ["attention", "mlp", "experts"]
[optim]
eps = 1e-4
[rollout]
temperature = 1.0
[algorithm]
mismatch = "token_tis"
[learn]
every = 4
keep = 2
"""


def _store(root: str) -> str:
    """Six rewarded traces recorded against the base, their logprobs a little below its own (the
    learner's importance ratios above 1)."""
    service = TinkerService(ServeConfig(model=MODEL, state_dir=os.path.join(root, "record")))
    path = os.path.join(root, "traces.db")
    store = TraceStore(path)
    tok = service.tokenizer
    texts = ["12+34=46", "7+8=15", "99+1=100", "12+34=47", "7+8=14", "99+1=101"]  # each prompt right, then wrong
    for i, (text, reward) in enumerate(zip(texts, [1.0, 1.0, 1.0, 0.0, 0.0, 0.0], strict=True)):
        tokens = tok.encode(text, add_special_tokens=False)
        with torch.no_grad():
            lp = token_logprobs(service.base.model, torch.tensor([tokens]))[0][0].tolist()
        prompt, completion = tokens[:4], tokens[4:]
        behaviour = [x - 0.05 * (i + 1) for x in lp[3:]]
        store.record(
            [Call(f"r{i}", 0, f"t{i}", "k", MODEL, MODEL, "chat", prompt, completion, behaviour, {"temperature": 1.0})]
        )
        store.add_feedback(Feedback(f"t{i}", "k", reward))
    store.close()
    return path


def worker(rank: int, world: int, flags: dict, root: str) -> None:
    learn = os.path.join(root, "learn.toml")
    service = TinkerService(serve_config(model=MODEL, state_dir=os.path.join(root, "sharded"), **flags))
    if rank > 0:
        follow_learning(service, learn)  # the CLI's path for ranks > 0
        service.follow()
        return
    published = []
    train = load_config(learn)
    service.learner = Learner(
        service.base,
        TraceStore(os.path.join(root, "traces.db")),
        train,
        lambda k, t, c: (published.append(k), service.registry.publish(MODEL, k, Revision(c, t), 2)),
        os.path.join(root, "sharded", "learner"),
        service.device,
        service.tokenizer,
        world=service.ranks,
    )
    greedy = {"max_tokens": 4, "temperature": 0.0}
    prompt = service.tokenizer.encode("12+34=", add_special_tokens=False)
    try:
        assert service.learner.due()
        got = service.learn(service.learner.prepare())
        sample = service.sample_many([SampleCall(f"{SERVED}:sample:{MODEL}@1", prompt, 1, greedy)])[0]
    finally:
        service.stop()
    assert published == [1] and got["revision"] == 1

    one = TinkerService(ServeConfig(model=MODEL, state_dir=os.path.join(root, "one")), alone=True)
    one.learner = Learner(
        one.base,
        TraceStore(os.path.join(root, "traces-copy.db")),
        train,
        lambda k, t, c: one.registry.publish(MODEL, k, Revision(c, t), 2),
        os.path.join(root, "one", "learner"),
        one.device,
        one.tokenizer,
        world=one.ranks,  # one process inside the group: a world of one
    )
    want = one.learner.step()
    for key in ("loss", "grad_norm", "is_ratio_mean", "sequences"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    mine = load_file(os.path.join(root, "sharded", "learner", "revision-1", "adapter.safetensors"))
    theirs = load_file(os.path.join(root, "one", "learner", "revision-1", "adapter.safetensors"))
    assert {k for k in mine if k != "rng.torch"} == {k for k in theirs if k != "rng.torch"}
    worst = max(float((mine[k] - theirs[k]).abs().max()) for k in theirs if k.startswith("param."))
    assert float(max(t.abs().max() for k, t in theirs.items() if k.endswith("lora_B"))) > 0, (got, sorted(theirs)[:5])
    diffs = sorted(
        ((float((mine[k] - theirs[k]).abs().max()), k) for k in theirs if k.startswith("param.")), reverse=True
    )
    assert worst <= 1e-6, diffs[:6]
    (tokens, _, _), *_ = sample[0]
    (want_tokens, _, _), *_ = one.sample_many([SampleCall(f"{SERVED}:sample:{MODEL}@1", prompt, 1, greedy)])[0][0]
    assert tokens == want_tokens


def get_json(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return json.loads(r.read())


LAYOUTS = {  # id: (ranks, service flags)
    "tp2-ep2": (4, {"tp": 2, "ep": 2}),
    "pp2": (2, {"pp": 2}),
    "pp2-ep2-microbatches2": (4, {"pp": 2, "ep": 2, "pp_microbatches": 2}),
    "dp2-fsdp": (2, {"fsdp": True}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_learning_server_on_sharded_ranks_publishes_one_process_revisions(tmp_path, layout):
    world, flags = LAYOUTS[layout]
    (tmp_path / "learn.toml").write_text(LEARN)
    shutil.copy(_store(str(tmp_path)), tmp_path / "traces-copy.db")
    run_ranks(worker, world, flags, str(tmp_path))


def test_what_a_sharded_learner_cannot_do_yet_is_named(tmp_path):
    """A gate samples on one process and micro-batches of unevenly split rows pass a different number
    of times on each rank: a learner with either is refused by name under torchrun."""
    run_ranks(_refused, 2, str(tmp_path))


def _refused(rank: int, world: int, root: str) -> None:
    service = TinkerService(serve_config(model=MODEL, state_dir=os.path.join(root, str(rank)), ep=2))
    gated = 'gate = "traces"\nreward = "reward_fns:even_first_token"\n'
    for i, extra in enumerate(("[parallel]\nmicro_batch_rows = 2\n", "", "")):
        path = os.path.join(root, f"refused-{rank}-{i}.toml")
        with open(path, "w") as f:
            f.write(LEARN + (gated if i == 1 else "") + extra)
        if i == 2:  # the same learner is fine without them
            follow_learning(service, path)
            continue
        with pytest.raises(ConfigError, match="leave learn.gate, parallel.micro_batch_rows"):
            follow_learning(service, path)


def test_the_cli_learns_under_torchrun_and_rolls_back_on_every_rank(tmp_path):
    """`torchrun --nproc-per-node 4 -m trillora serve MODEL --tp 2 --ep 2 --record STORE --learn CONFIG`
    over a store with rewarded traces: revision 1 is published, a chat is answered with it (both
    ranks serve it) and recorded as its, and a rollback reaches every rank (the docs' command, with
    a free port and the test's files)."""
    (tmp_path / "learn.toml").write_text(LEARN)
    store = _store(str(tmp_path))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port())]
        + ["-m", "trillora", "serve", MODEL, "--tp", "2", "--ep", "2", "--port", str(port)]
        + ["--state-dir", str(tmp_path / "s")]
        + ["--record", store, "--learn", str(tmp_path / "learn.toml")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        failed = wait_for_health(proc, url, 180)
        assert failed is None, failed
        deadline = time.monotonic() + 120
        while (listing := get_json(url, "/v1/revisions"))["current"] != 1:
            assert time.monotonic() < deadline and not listing["failures"], listing
            time.sleep(0.5)
        assert (tmp_path / "s" / "learner" / "revision-1" / "adapter.safetensors").is_file()
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "12+34="}], "max_tokens": 4}
        chat["metadata"] = {"trace_id": "after"}
        status, out = post_json(url, "/v1/chat/completions", chat)
        assert status == 200 and out["choices"][0]["message"]["content"] is not None, out
        assert [c.revision for c in TraceStore(store).calls("after")] == [f"{SERVED}:sample:{MODEL}@1"]
        status, out = post_json(url, "/v1/revisions/rollback", {"revision": 1})
        assert status == 200 and out["current"] == 1, out
    finally:
        proc.terminate()  # torchrun's agent passes SIGTERM on to the ranks (and exits 1 for it)
        output = proc.communicate(timeout=60)[0].decode(errors="replace")
    assert "a learning round failed" not in output, output[-3000:]
