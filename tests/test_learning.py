"""`serve --record --learn`: the served policy trains on its rewarded traffic in its own adapter slot
and publishes revisions while it serves. The learner (`trainer/learner.py`) is checked on hand-built
traces (importance ratios computed by hand, stale and deleted traces), then through HTTP with the
`openai` SDK as an app sends it (revisions swapped in while every request is answered, rollback,
restart)."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from docs_pages import bash_block
from engine_helpers import post_json, running_server, serve_process

from trillora.checkpoint.train_state import read_adapter_state
from trillora.cli.commands import start_learning
from trillora.config import load_config
from trillora.policy.logprobs import token_logprobs
from trillora.serve.config import ServeConfig
from trillora.serve.tinker.service import TinkerService
from trillora.traces import Call, Feedback, TraceStore
from trillora.trainer.learner import Learner

LEARN = """seed = 0
[lora]
rank = 4
targets = ["attention", "mlp", "experts"]
[optim]
lr = 0.002
[rollout]
temperature = 1.0
[algorithm]
mismatch = "token_tis"
mismatch_cap = {cap}
[learn]
every = {every}
max_staleness = 2
keep = 2
"""


def learn_config(tmp_path, every: int = 2, cap: float = 2.0):
    path = tmp_path / "learn.toml"
    path.write_text(LEARN.format(every=every, cap=cap))
    return path


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return TinkerService(ServeConfig(model="tiny-moe-chat", state_dir=str(tmp_path_factory.mktemp("state"))))


def served_logprobs(service, tokens: list[int]) -> list[float]:
    """The base's logprobs of tokens[1:] (what a fresh adapter, B = 0, also gives)."""
    with torch.no_grad():
        return token_logprobs(service.base.model, torch.tensor([tokens]))[0][0].tolist()


def record(
    store, service, trace: str, revision: str, shift: float, reward: float | None, prompt_len: int = 6, owner: str = "k"
):
    tokens = [1, 100, 34, 32, 18, 31, 99, 62, 21, 14, 33, 98]
    lp = served_logprobs(service, tokens)
    prompt, completion = tokens[:prompt_len], tokens[prompt_len:]
    behaviour = [x - shift for x in lp[prompt_len - 1 :]]  # the behaviour policy gave each token e^-shift of ours
    store.record(
        [
            Call(
                f"r-{trace}",
                0,
                trace,
                owner,
                "tiny-moe-chat",
                revision,
                "chat",
                prompt,
                completion,
                behaviour,
                {"temperature": 1.0},
            )
        ]
    )
    if reward is not None:
        store.add_feedback(Feedback(trace, owner, reward))


def test_traces_from_an_older_revision_carry_their_importance_ratios(service, tmp_path):
    """Hand-built traces whose recorded logprobs sit 0.2 below the learner's at every token: the
    round's ratio is e^0.2 = 1.2214 on every token; with mismatch_cap 1.1, every token is capped
    (is_limited_frac 1, weights 1.1). A trace served 3 revisions back (max_staleness 2) is dropped
    and counted, a deleted one is never trained on, and nothing is trained twice."""
    store = TraceStore(str(tmp_path / "t.db"))
    published = []
    learner = Learner(
        service.base,
        store,
        load_config(learn_config(tmp_path, cap=1.1)),
        lambda k, tensors, config: published.append(k),
        tmp_path / "learner",
        service.device,
    )
    learner.revision = 3  # as if three revisions were out already
    record(store, service, "a", "tiny-moe-chat@3", 0.2, 1.0)
    record(store, service, "b", "tiny-moe-chat@2", 0.2, 0.0)
    record(store, service, "stale", "tiny-moe-chat@0", 0.2, 1.0)
    record(store, service, "gone", "tiny-moe-chat@3", 0.2, 1.0)
    store.delete(trace_id="gone")
    assert learner.due()
    row = learner.step()
    assert row["is_ratio_mean"] == pytest.approx(math.exp(0.2), abs=1e-4)
    assert row["is_ratio_min"] == pytest.approx(math.exp(0.2), abs=1e-4) and row["is_ratio_max"] == pytest.approx(
        math.exp(0.2), abs=1e-4
    )
    assert row["is_limited_frac"] == 1.0 and row["is_weight_mean"] == pytest.approx(1.1)
    assert row["dropped_stale"] == 1 and row["traces"] == 2 and row["served_by_max_lag"] == 1
    assert row["revision"] == 4 and published == [4] and row["grad_norm"] > 0
    trained = {r[0]: r[1] for r in store._read("SELECT trace_id, revision FROM trained")}
    assert trained == {"a": 4, "b": 4, "stale": -1}  # "gone" was deleted before any round saw it
    record(store, service, "long", "tiny-moe-chat@4", 0.0, 1.0)  # 12 tokens, over a round's budget of 10
    learner.cfg = dataclasses.replace(learner.cfg, learn=dataclasses.replace(learner.cfg.learn, max_tokens=10))
    assert (
        learner.step() is None
        and {r[0]: r[1] for r in store._read("SELECT trace_id, revision FROM trained")}["long"] == -1
    )
    assert not learner.due() and learner.step() is None  # nothing is trained twice
    # a restarted learner resumes from the revision it published, adapter and AdamW state included
    again = Learner(
        service.base,
        store,
        load_config(learn_config(tmp_path, cap=1.1)),
        lambda k, tensors, config: published.append(k),
        tmp_path / "learner",
        service.device,
    )
    assert again.revision == 4 and published == [4, 4]
    for k, p in learner.adapter.params.items():
        assert torch.equal(p, again.adapter.params[k]), k
    state = learner.adapter.optimizer.state[learner.adapter.params[next(iter(learner.adapter.params))]]
    assert torch.equal(
        state["exp_avg"],
        again.adapter.optimizer.state[again.adapter.params[next(iter(again.adapter.params))]]["exp_avg"],
    )
    # a revision is a saved state like a Tinker client's (`read_adapter_state`: what load_state and resume_from read)
    saved = read_adapter_state(tmp_path / "learner" / "revision-4")
    assert saved.optimizer_steps == 1 and saved.lora["rank"] == learner.adapter.config.rank
    assert saved.lora["targets"] == tuple(learner.adapter.config.targets) and saved.lora["alpha"] == service.base.alpha
    for k, p in learner.adapter.params.items():
        assert torch.equal(saved.tensors[f"param.{k}"], p.detach()), k


def test_unscored_traces_take_the_reward_function_and_a_bad_one_is_left_out(service, tmp_path):
    """`learn.reward = "module:function"` scores traces nobody gave feedback at training time; a
    function returning NaN leaves its traces out (counted) instead of reaching the update."""
    store = TraceStore(str(tmp_path / "t.db"))
    for name in ("served_tokens", "not_a_number"):
        path = tmp_path / f"{name}.toml"
        path.write_text(LEARN.format(every=1, cap=2.0) + f'reward = "reward_fns:{name}"\n')
        record(store, service, f"t-{name}", "tiny-moe-chat", 0.0, None)
        learner = Learner(service.base, store, load_config(path), lambda *a: None, tmp_path / name, service.device)
        row = learner.step()
        if name == "served_tokens":
            assert row["traces"] == 1 and row["reward_mean"] == 1.0  # 6 completion tokens
        else:
            assert row is None
            assert {r[0]: r[1] for r in store._read("SELECT trace_id, revision FROM trained")}["t-not_a_number"] == -1


def test_the_traces_gate_replays_held_out_traces_that_are_never_trained_on(service, tmp_path):
    """`learn.gate = "traces"`: the traces whose key hashes into `learn.holdout` are marked held out
    and never trained on; each revision replays their first prompts (seeded, the adapter in its slot)
    and `learn.reward` scores the replays. A larger held-out set starts a new bar."""
    import reward_fns

    from trillora.rollout import LocalEngine, SamplingParams
    from trillora.tasks.prompts import stop_tokens
    from trillora.traces.experience import held_out
    from trillora.traces.types import HELD_OUT

    path = tmp_path / "gate.toml"
    path.write_text(
        LEARN.format(every=1, cap=2.0) + 'gate = "traces"\nholdout = 0.5\ngate_traces = 16\n'
        'reward = "reward_fns:even_first_token"\n'
    )
    store = TraceStore(str(tmp_path / "t.db"))
    learner = Learner(
        service.base, store, load_config(path), lambda *a: None, tmp_path / "learner", service.device, service.tokenizer
    )
    keys = [f"t{i}" for i in range(10)]
    for i, t in enumerate(keys):
        record(store, service, t, "tiny-moe-chat", 0.0, None, prompt_len=2 + i % 8)
    held = sorted(t for t in keys if held_out(("k", t), 0.5))
    assert held == ["t2", "t3", "t4", "t5"]  # the first 8 bytes of sha256("k/t<i>") mod 10000 below 5000
    row = learner.step()
    marks = dict(store._read("SELECT trace_id, revision FROM trained"))
    assert sorted(t for t, r in marks.items() if r == HELD_OUT) == held
    assert {t for t, r in marks.items() if r == 1} == set(keys) - set(held) and row["traces"] == 6

    engine = LocalEngine.sharing(service.base.model, service.tokenizer.pad_token_id or 0)  # the replays, by hand
    firsts = [store.calls(t, owner="k")[0] for t in held]
    params = SamplingParams(
        max_new_tokens=6, temperature=1.0, stop_token_ids=stop_tokens(service.tokenizer, chat=True), seed=4242
    )
    with service.base.use(learner.adapter), torch.no_grad():
        out = engine.generate([c.prompt_ids for c in firsts], 1, params)
    scores = [
        reward_fns.even_first_token([dataclasses.replace(c, completion_ids=o.token_ids)])
        for c, (o,) in zip(firsts, out, strict=True)
    ]
    assert row["gate_score"] == sum(scores) / len(scores) and learner.best == row["gate_score"]
    basis = learner.best_basis
    assert basis.startswith("traces:4:")

    for t in ("t10", "t11", "t12"):  # t12 hashes into the held-out share: the set grows, a new bar
        record(store, service, t, "tiny-moe-chat@1", 0.0, None)
    row = learner.step()
    assert row["revision"] == 2 and learner.best_basis.startswith("traces:5:") and learner.best == row["gate_score"]
    marks = dict(store._read("SELECT trace_id, revision FROM trained"))
    assert (marks["t10"], marks["t11"], marks["t12"]) == (2, 2, HELD_OUT)


def test_a_traces_gate_needs_a_reward_function_and_gates_are_named(tmp_path):
    from trillora.config import ConfigError

    with pytest.raises(ConfigError, match="learn.gate='traces' scores each replayed trace with learn.reward"):
        load_config(None, ['learn.gate="traces"'])
    with pytest.raises(ConfigError, match="learn.gate='always'; allowed: '', 'env', 'traces'"):
        load_config(None, ['learn.gate="always"'])


def test_a_round_whose_update_is_not_finite_consumes_its_traces(service, tmp_path):
    """A batch whose loss or gradient is not finite is not published and not retried every second:
    its traces are marked left out, and the adapter stays at the last published revision."""
    store = TraceStore(str(tmp_path / "t.db"))
    learner = Learner(
        service.base,
        store,
        load_config(learn_config(tmp_path, every=1)),
        lambda *a: None,
        tmp_path / "learner",
        service.device,
    )
    record(store, service, "poison", "tiny-moe-chat", 0.0, 1.0)
    learner.update = lambda batch: {"skipped_update": 1.0, "grad_norm": float("nan")}
    row = learner.step()
    assert row["skipped"] and row["revision"] == 0 and not learner.due()
    assert {r[0]: r[1] for r in store._read("SELECT trace_id, revision FROM trained")} == {"poison": -1}


def test_the_gate_keeps_a_worse_revision_out(service, tmp_path):
    """`learn.gate`: each revision plays the held-out episodes of `[task]` (the calculator env) before
    it is served; the first sets the bar, one scoring below it by more than the tolerance is not
    published, and the learner goes back to the revision that was."""
    path = tmp_path / "gate.toml"
    path.write_text(
        LEARN.format(every=1, cap=2.0) + 'gate = "env"\ngate_tolerance = 0.0\n'
        '[task]\nname = "env"\noptions = { env = "trillora.envs.calculator:dataset", digits = [4, 3] }\n'
        "eval_problems = 4\nmax_turns = 3\n"
    )
    store, published = TraceStore(str(tmp_path / "t.db")), []
    learner = Learner(
        service.base,
        store,
        load_config(path),
        lambda k, tensors, config: published.append(k),
        tmp_path / "learner",
        service.device,
        service.tokenizer,
    )
    record(store, service, "one", "tiny-moe-chat", 0.0, 1.0)
    row = learner.step()
    assert published == [1] and 0.0 <= row["gate_score"] <= 1.0 and learner.best == row["gate_score"]
    assert learner.history[-1]["gate_score"] == row["gate_score"]  # what /v1/models shows for NAME@1
    first = {k: p.detach().clone() for k, p in learner.adapter.params.items()}
    learner.gate = lambda: (learner.best - 0.5, "env")  # the next revision does worse on the held-out episodes
    record(store, service, "two", "tiny-moe-chat@1", 0.0, 1.0)
    row = learner.step()
    assert row["gated"] and row["revision"] == 1 and published == [1] and learner.revision == 1
    for k, p in learner.adapter.params.items():
        assert torch.equal(p, first[k]), k  # back at the published revision


def test_a_round_is_due_by_count_or_by_time(service, tmp_path):
    path = tmp_path / "due.toml"
    path.write_text(LEARN.format(every=3, cap=2.0) + "minutes = 0.5\n")
    store = TraceStore(str(tmp_path / "t.db"))
    learner = Learner(service.base, store, load_config(path), lambda *a: None, tmp_path / "l", service.device)
    assert not learner.due()  # nothing new
    record(store, service, "one", "tiny-moe-chat", 0.0, 1.0)
    assert not learner.due()  # one of three, and not half a minute yet
    learner.last_round -= 31
    assert learner.due()  # half a minute with one new rewarded trace
    learner.last_round += 31
    record(store, service, "two", "tiny-moe-chat", 0.0, 1.0)
    record(store, service, "three", "tiny-moe-chat", 0.0, None)  # no feedback: not counted (feedback only)
    assert not learner.due()
    store.add_feedback(Feedback("three", "k", 0.0))
    assert learner.due()


def test_group_and_running_baselines():
    from trillora.traces.experience import Baselines, advantages

    b = Baselines(decay=0.5)
    # traces 0 and 1 ask the same task: group-relative; 2 and 3 are alone: their tag's running mean
    out = advantages([1.0, 0.0, 1.0, 0.0], [(1,), (1,), (2,), (3,)], ["x", "x", "t", "t"], b)
    # tag t: the first trace sets the mean (1.0, advantage 0), the second gets 0.0 - 1.0, the mean moves to
    # 0.5 · 1.0 + 0.5 · 0.0 = 0.5
    assert out == [0.5, -0.5, 0.0, -1.0] and b.means == {"t": 0.5}


def test_one_keys_feedback_trains_nothing_of_another_unless_asked(service, tmp_path):
    """Another key's thumbs trained the revision every key was served (83 revisions in 90 s made the
    operator's `1+1=` start wrong); and traces of one prompt from two keys formed one group, so one
    key's rewards moved the other's baseline. Now the learner takes the keys it is given, and groups
    each key's traces apart."""
    from trillora.traces.experience import Baselines, collect

    store = TraceStore(str(tmp_path / "t.db"))
    for trace, owner, reward in (("a1", "a", 1.0), ("a2", "a", 0.0), ("b1", "b", 1.0), ("b2", "b", 1.0)):
        record(store, service, trace, "tiny-moe-chat", 0.0, reward, owner=owner)
    learn, vocab = load_config(learn_config(tmp_path)).learn, service.base.model.args.vocab_size
    assert learn.from_keys == "operator"
    every = collect(store, 0, learn, 1.0, Baselines(0.9), None, vocab)
    assert every.trace_ids == [("a", "a1"), ("a", "a2"), ("b", "b1"), ("b", "b2")]
    assert every.advantages == [0.5, -0.5, 0.0, 0.0]  # a's mean 0.5, b's 1.0 (pooled: 0.75 for all four)
    only_a = collect(store, 0, learn, 1.0, Baselines(0.9), None, vocab, owners={"a"})
    assert only_a.trace_ids == [("a", "a1"), ("a", "a2")] and only_a.dropped == {"other_key": 2}
    assert only_a.left_out == [("b", "b1"), ("b", "b2")]
    with pytest.raises(Exception, match="learn.from_keys='mine'; allowed: 'operator', 'all'"):
        load_config(learn_config(tmp_path), ["learn.from_keys=mine"])


def post(url: str, path: str, body: dict, key: str = "k1") -> tuple[int, dict]:
    return post_json(url, path, body, key)


def get(url: str, path: str, key: str = "k1") -> dict:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {key}"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())


@pytest.mark.slow
def test_a_learning_server_swaps_revisions_in_while_every_request_is_answered(tmp_path):
    """4 app threads send chat turns and thumbs up / down through HTTP while the learner trains every
    2 rewarded traces: revisions are published and requests move onto them (the recorded revision
    says which served each), every request is answered, a rollback points the name back, and a
    restarted server resumes from the newest revision on disk."""
    cfg = ServeConfig(
        model="tiny-moe-chat",
        port=0,
        api_key=["k1", "k2"],
        record=str(tmp_path / "t.db"),
        state_dir=str(tmp_path / "state"),
    )
    gen = running_server(cfg)
    server = next(gen)
    revisions = start_learning(server, str(learn_config(tmp_path)), poll_seconds=0.05)
    url = f"http://127.0.0.1:{cfg.port}"
    statuses, stop = [], threading.Event()

    def app(i: int) -> None:
        n = 0
        while not stop.is_set():
            status, out = post(
                url,
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": f"{i}+{n}="}], "max_tokens": 6, "metadata": {"task": "add"}},
            )
            statuses.append(status)
            if status == 200:
                right = out["choices"][0]["message"]["content"].strip() == str(i + n)
                statuses.append(post(url, "/v1/feedback", {"trace_id": out["trace_id"], "reward": float(right)})[0])
            n += 1

    status, guest = post(url, "/v1/completions", {"prompt": "1+1=", "max_tokens": 2}, key="k2")  # not the operator
    assert (
        status == 200 and post(url, "/v1/feedback", {"trace_id": guest["trace_id"], "reward": 1.0}, key="k2")[0] == 200
    )
    threads = [threading.Thread(target=app, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    deadline = time.monotonic() + 300
    while (revisions.current or 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    stop.set()
    [t.join(120) for t in threads]
    revisions.stop()  # no round after this one: the listing stays what it says
    listing = get(url, "/v1/revisions")
    assert listing["current"] >= 3 and listing["failures"] == 0, listing
    assert [r["revision"] for r in listing["revisions"]] == [listing["current"] - 1, listing["current"]]  # keep = 2
    assert set(statuses) == {200} and len(statuses) > 24
    served_by = {
        c.revision for t in TraceStore(cfg.record).traces() for c in TraceStore(cfg.record).calls(t["trace_id"])
    }
    assert "served:sample:tiny-moe-chat" in served_by and any("@" in r for r in served_by)  # base first, then revisions
    row = listing["revisions"][-1]["training"]
    assert row["traces"] >= 2 and "is_ratio_mean" in row and "loss" in row
    seen = get(url, "/v1/revisions", key="k2")  # an app's key: the revisions, not the operator's training rows
    assert [r["revision"] for r in seen["revisions"]] == [r["revision"] for r in listing["revisions"]]
    assert all(r["training"] == {} for r in seen["revisions"]) and seen["last_error"] == ""
    assert not {"rounds", "failures", "skipped"} & set(seen) and listing["rounds"] >= 3  # the operator's counts
    trained = {t: k for _, t, k in TraceStore(cfg.record)._read("SELECT owner, trace_id, revision FROM trained")}
    assert trained[guest["trace_id"]] == -1  # learn.from_keys = "operator": another key's thumbs train nothing

    models = {m["id"]: m for m in get(url, "/v1/models")["data"]}
    current = listing["current"]
    assert models["tiny-moe-chat"]["serves"] == f"tiny-moe-chat@{current}"
    assert models[f"tiny-moe-chat@{current}"]["revision"] == current and models[f"tiny-moe-chat@{current}"]["current"]
    assert not models[f"tiny-moe-chat@{current - 1}"]["current"]
    status, out = post(url, "/v1/revisions/rollback", {}, key="k2")  # an app's key, not the operator's
    assert status == 403 and "needs the operator's key" in out["error"]["message"]
    status, out = post(url, "/v1/revisions/rollback", {})
    assert status == 200 and out["current"] == listing["current"] - 1
    status, out = post(url, "/v1/completions", {"prompt": "1+1=", "max_tokens": 2, "metadata": {"trace_id": "after"}})
    calls = TraceStore(cfg.record).calls("after")
    assert calls[0].revision.endswith(f"@{listing['current'] - 1}")
    status, out = post(url, "/v1/revisions/rollback", {"revision": 0})
    assert status == 404 and "is not kept" in out["error"]["message"]
    next(gen, None)

    gen = running_server(
        ServeConfig(model="tiny-moe-chat", port=0, api_key=["k1", "k2"], record=cfg.record, state_dir=cfg.state_dir)
    )
    server = next(gen)
    again = start_learning(server, str(learn_config(tmp_path)), poll_seconds=60)
    assert again.current == listing["current"]  # resumed from the newest revision on disk
    next(gen, None)


@pytest.mark.slow
def test_the_product_demo_runs_small(tmp_path):
    """`examples/product/run.py` at a small size: the app (the `openai` SDK only) for simulated users,
    the server learning from their feedback; every request answered, every call recorded, revisions
    published, the results file and its plot written (the committed 10-minute run is in the README)."""
    script = Path(__file__).resolve().parents[1] / "examples" / "product" / "run.py"
    out = tmp_path / "product.json"
    run = subprocess.run(
        [
            sys.executable,
            str(script),
            "--minutes",
            "0.4",
            "--idle-seconds",
            "3",
            "--eval-users",
            "8",
            "--eval-every",
            "12",
            "--clients",
            "4",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["requests_failed"] == 0 and report["record_failures"] == 0 and report["learning_failures"] == 0
    assert report["revisions_published"] >= 1 and len(report["evaluations"]) >= 2
    assert report["latency_s"]["learner idle"]["requests"] > 0 and report["latency_s"]["learner on"]["requests"] > 0
    assert all(0 <= r["served_by_max_lag"] <= 4 for r in report["revisions"])
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
def test_the_readme_learning_command_runs_as_written(tmp_path):
    """The README's `serve --record --learn` line in a fresh folder (on a free port, appended): it
    serves, records and lists its revisions (none yet: examples/product/learn.toml trains every 32
    rewarded conversations); then the offline `trillora train task.name=traces` line on what it
    recorded. The demo line is run small by `test_the_product_demo_runs_small`."""
    root = Path(__file__).resolve().parents[1]
    lines = [shlex.split(line) for line in bash_block("The product loop: `serve --record --learn`")]
    assert lines[0][:2] == ["trillora", "serve"] and lines[1] == ["python", "examples/product/run.py"]
    assert lines[2][:2] == ["trillora", "train"]
    shutil.copytree(root / "examples", tmp_path / "examples")
    serve = lines[0]
    key = serve[serve.index("--api-key") + 1]
    proc, url = serve_process(serve[1:], cwd=tmp_path)
    try:
        assert (
            post(
                url,
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "12+30="}], "max_tokens": 4},
                key=key,
            )[0]
            == 200
        )
        req = urllib.request.Request(url + "/v1/revisions", headers={"Authorization": f"Bearer {key}"})
        listing = json.loads(urllib.request.urlopen(req, timeout=30).read())
        assert listing["model"] == "tiny-moe-chat" and listing["current"] is None and listing["failures"] == 0
    finally:
        proc.terminate()
        proc.wait(30)
    assert (tmp_path / "runs" / "traces.db").exists()
    out = subprocess.run(
        [str(Path(sys.executable).parent / "trillora"), *lines[2][1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["rounds"] == 0  # the one conversation above has no feedback: nothing to learn yet
    assert (tmp_path / "runs" / "from-traces" / "adapter" / "adapter_config.json").exists()


def test_trillora_train_learns_from_a_store_offline(service, tmp_path):
    """`trillora train task.name="traces"`: the learner's rounds over a store, offline. The rounds are
    logged (importance ratio 1 in the first, where the learner is still the base that served the
    traces; not in the second, one revision later), traces of another vocabulary are left out, the
    store remembers what was trained, and the exported PEFT adapter holds exactly the learner's tensors."""
    from safetensors.torch import load_file

    from trillora import lora
    from trillora.checkpoint import load_model, resolve_model_path
    from trillora.trainer import train

    db = tmp_path / "t.db"
    store = TraceStore(str(db))
    for i, reward in enumerate([1.0, 0.0, 1.0, 0.0, 1.0]):
        record(store, service, f"t{i}", "tiny-moe-chat", 0.0, reward, prompt_len=4 + i)
    overrides = [
        'task.name="traces"',
        f'task.options={{store = "{db}"}}',
        "steps=5",
        f'out_dir="{tmp_path}"',
        'name="offline"',
        "lora.rank=4",
        'lora.targets=["mlp", "experts"]',
        "learn.max_tokens=36",
    ]
    wrong = train(load_config(None, [*overrides, 'name="wrong"']))  # the default model (tiny-moe): another vocabulary
    wrong_rows = [json.loads(line) for line in (tmp_path / "wrong" / "metrics.jsonl").read_text().splitlines()]
    assert wrong["rounds"] == 0 and wrong_rows == []
    assert {r[1] for r in store._read("SELECT trace_id, revision FROM trained")} == {-1}  # left out, counted as such
    reset = "INSERT INTO pending (owner, trace_id, rewarded) SELECT DISTINCT owner, trace_id, 1 FROM requests"
    store._write([("DELETE FROM trained", [()]), ("DELETE FROM pending", [()]), (reset, [()])])  # never left out
    overrides.append('model.path="tiny-moe-chat"')
    summary = train(load_config(None, overrides))
    rows = [json.loads(line) for line in (tmp_path / "offline" / "metrics.jsonl").read_text().splitlines()]
    assert summary["rounds"] == len(rows) == 2 and summary["traces"] == 5  # 12 tokens a trace, 36 a round
    assert [r["traces"] for r in rows] == [3, 2] and rows[0]["is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert rows[1]["served_by_max_lag"] == 1 and rows[1]["is_ratio_mean"] != pytest.approx(
        1.0, abs=1e-5
    )  # off-policy now
    assert store.untrained(rewarded_only=True) == []
    saved = load_file(str(tmp_path / "offline" / "revisions" / "revision-2" / "adapter.safetensors"))
    model = load_model(resolve_model_path("tiny-moe-chat"))
    lora.load_adapter(model, tmp_path / "offline" / "adapter")
    for name, p in lora.lora_parameters(model):
        torch.testing.assert_close(p, saved[f"param.{name}"], rtol=0, atol=0, msg=name)
    assert train(load_config(None, overrides))["rounds"] == 0  # nothing new since


def test_models_list_revisions_with_their_gate_scores(tmp_path):
    from types import SimpleNamespace

    from trillora.serve.revisions import Revisions

    service = TinkerService(ServeConfig(model="tiny-moe-chat", state_dir=str(tmp_path / "state")))
    revisions = Revisions(service, "tiny-moe-chat", keep=2)
    revisions.learner = SimpleNamespace(
        history=[
            {"revision": 1, "gate_score": 0.5},
            {"revision": 2, "gate_score": 0.75},
            {"revision": 3, "gate_score": 0.8},
        ]
    )
    for k in (1, 2, 3):
        revisions.publish(k, {}, None)
    assert set(service.served()) == {"tiny-moe-chat", "tiny-moe-chat@2", "tiny-moe-chat@3"}  # keep = 2
    assert revisions.models() == {
        "tiny-moe-chat@2": {"revision": 2, "current": False, "gate_score": 0.75},
        "tiny-moe-chat@3": {"revision": 3, "current": True, "gate_score": 0.8},
        "tiny-moe-chat": {"serves": "tiny-moe-chat@3"},
    }
    assert service.served()["tiny-moe-chat"] is service.served()["tiny-moe-chat@3"]  # the alias takes the revision
