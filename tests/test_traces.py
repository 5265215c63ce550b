"""`serve --record`: served calls and feedback in the trace store (SQLite and a real PostgreSQL
server), what a recorded session trains on (the served ids, never re-tokenized text), the
`trillora traces` command, and what a store that fails or a kill -9 leaves."""

from __future__ import annotations

import json
import math
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from engine_helpers import post_json, running_server, serve_process
from pg_server import postgres_server

from trillora import lora
from trillora.checkpoint import load_model, resolve_model_path
from trillora.policy.logprobs import token_logprobs
from trillora.serve.config import ServeConfig
from trillora.traces import Call, Feedback, TooMuchFeedback, TraceError, TraceStore, UnknownTrace
from trillora.traces.trajectory import samples_of


@pytest.fixture(scope="module")
def postgres():
    yield from postgres_server()


def fresh_database(url: str, name: str) -> str:
    import psycopg

    with psycopg.connect(url, autocommit=True) as db:
        db.execute(f"DROP DATABASE IF EXISTS {name}")
        db.execute(f"CREATE DATABASE {name}")
    return url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(params=["sqlite", "postgres"])
def store_at(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "traces.db")
    return fresh_database(request.getfixturevalue("postgres"), f"t_{abs(hash(request.node.name)) % 10**8}")


def call(
    response: str,
    trace: str,
    owner: str = "k1",
    user: str = "",
    created: float | None = None,
    choice: int = 0,
    prompt=(1, 2, 3),
    completion=(4, 5),
    logprobs=(-0.5, -0.25),
) -> Call:
    return Call(
        response,
        choice,
        trace,
        owner,
        "tiny",
        "r0",
        "chat",
        list(prompt),
        list(completion),
        list(logprobs),
        {"temperature": 1.0},
        "stop",
        [],
        user,
        created=created if created is not None else time.time(),
    )


def test_store_round_trip_feedback_and_delete(store_at):
    store = TraceStore(store_at)
    old = time.time() - 3 * 86400
    store.record([call("r1", "a", user="alice", created=old), call("r1", "a", user="alice", created=old, choice=1)])
    store.record(
        [call("r2", "a", user="alice", created=old + 1, prompt=(1, 2, 3, 4, 5, 6), completion=(7,), logprobs=(-1.0,))]
    )
    store.record([call("r3", "b", owner="k2", user="bob")])
    got = store.calls("a")
    assert [(c.response_id, c.choice) for c in got] == [("r1", 0), ("r1", 1), ("r2", 0)]
    assert (
        got[2].prompt_ids == [1, 2, 3, 4, 5, 6] and got[2].logprobs == [-1.0] and got[0].params == {"temperature": 1.0}
    )
    assert store.calls("a", owner="k2") == []  # another key's traffic is not its to read

    store.add_feedback(Feedback("a", "k1", 1.0, label="thumbs_up"))
    store.add_feedback(Feedback("", "k1", 0.0, response_id="r2"))  # by response id: the trace is found
    with pytest.raises(UnknownTrace, match="no trace 'a' in this key's recorded traffic"):
        store.add_feedback(Feedback("a", "k2", 1.0))  # another key: told apart from nothing
    with pytest.raises(UnknownTrace, match="no response 'zz'"):
        store.add_feedback(Feedback("", "k1", 1.0, response_id="zz"))
    for bad in (float("nan"), float("inf"), True, "1", 1e308, 10**30):  # bounded: one huge reward overflows a round
        with pytest.raises(TraceError, match=r"reward must be a finite number in \[-1e\+06, 1e\+06\]"):
            store.add_feedback(Feedback("a", "k1", bad))
    store.record([call("r9", "a", owner="k2")])  # another key naming the same trace id holds another trace
    store.add_feedback(Feedback("a", "k2", -1.0))
    assert [f.reward for f in store.feedback("a", owner="k2")] == [-1.0] and len(store.calls("a", owner="k1")) == 3
    for _ in range(29):
        store.add_feedback(Feedback("b", "k2", 1.0))
    with pytest.raises(TooMuchFeedback, match="trace 'b' already holds 32 rewards"):
        for _ in range(4):
            store.add_feedback(Feedback("b", "k2", 1.0))
    summary = {(t["owner"], t["trace_id"]): t for t in store.traces()}
    a = summary["k1", "a"]
    assert a["calls"] == 3 and a["rewards"] == 2 and a["mean_reward"] == 0.5  # k2's -1 is k2's trace's
    assert summary["k2", "a"]["mean_reward"] == -1.0 and summary["k2", "b"]["rewards"] == 32
    assert [t["trace_id"] for t in store.traces(older_than=86400)] == ["a"]

    with pytest.raises(TraceError, match="needs an age, a user id or a trace id"):
        store.delete()
    assert store.delete(older_than=86400) == 1
    assert store.calls("a", owner="k1") == [] and store.feedback("a", owner="k1") == [] and len(store.calls("b")) == 1
    assert len(store.calls("a", owner="k2")) == 1  # the other key's trace of that name stays
    assert store.delete(user_id="bob") == 1 and store.delete(trace_id="a") == 1 and store.traces() == []
    store.close()


def test_a_recorded_session_trains_on_the_ids_it_was_served(tmp_path):
    """Two chat turns under one X-Trace-Id through the `openai` SDK with a loaded adapter: the record
    holds the ids and logprobs the response returned, the session becomes one sequence (the second
    prompt extends the first prompt + completion), and an independent model with the same adapter
    (`lora.load_adapter`) recomputes the recorded logprobs to 1e-4 at the sampled positions."""
    import openai

    model = load_model(resolve_model_path("tiny-moe-chat"))
    lora.apply_lora(model, lora.LoraConfig(rank=4))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in lora.lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    lora.save_adapter(model, tmp_path / "policy")
    store = tmp_path / "traces.db"
    gen = running_server(
        ServeConfig(model="tiny-moe-chat", port=0, api_key="k1", adapter_root=str(tmp_path), record=str(store))
    )
    server = next(gen)
    url = f"http://127.0.0.1:{server.cfg.port}"
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "policy", "lora_path": "policy"})[0] == 200
    client = openai.OpenAI(base_url=url + "/v1", api_key="k1")
    messages = [{"role": "user", "content": "What is 12+30?"}]
    served = []
    for turn in range(2):
        r = client.chat.completions.create(
            model="policy",
            messages=messages,
            max_tokens=40,
            temperature=0.7,
            seed=turn,
            logprobs=True,
            extra_headers={"X-Trace-Id": "session-1"},
            extra_body={"return_token_ids": True, "user": "alice"},
        )
        assert r.model_extra["trace_id"] == "session-1"
        served.append(r)
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "And 5+5?"},
        ]
    health = json.loads(urllib.request.urlopen(url + "/health").read())["recording"]
    assert health["recorded"] == 2 and health["failed"] == 0
    next(gen, None)

    calls = TraceStore(str(store)).calls("session-1")
    for c, r in zip(calls, served, strict=True):
        choice = r.choices[0]
        assert c.prompt_ids == r.model_extra["prompt_token_ids"] and c.completion_ids == choice.model_extra["token_ids"]
        assert c.logprobs == [t.logprob for t in choice.logprobs.content]
        assert (c.response_id, c.model, c.user_id, c.kind) == (r.id, "policy", "alice", "chat")
        assert c.params["temperature"] == 0.7 and c.finish_reason == choice.finish_reason
    samples = samples_of(calls)
    assert [c.finish_reason for c in calls] == ["stop", "stop"]  # each turn ended at <|im_end|>, which the template
    assert len(samples) == 1 and samples[0].tokens == calls[1].prompt_ids + calls[1].completion_ids  # renders back
    assert sum(s.mask.count(1) for s in samples) == sum(len(c.completion_ids) for c in calls)

    oracle = load_model(resolve_model_path("tiny-moe-chat"))
    lora.load_adapter(oracle, tmp_path / "policy")
    with torch.no_grad():
        for s in samples:
            logp, _ = token_logprobs(oracle, torch.tensor([s.tokens]), temperature=0.7)  # [1, T-1]
            at = [i for i, m in enumerate(s.mask) if m]
            torch.testing.assert_close(
                logp[0, [i - 1 for i in at]], torch.tensor([s.logprobs[i] for i in at]), rtol=0, atol=1e-4
            )


def post(url: str, path: str, body: dict, key: str | None = "k1") -> tuple[int, dict]:
    return post_json(url, path, body, key)


def test_feedback_errors_name_the_culprit_and_a_failing_store_never_blocks_serving(tmp_path):
    store = tmp_path / "traces.db"
    gen = running_server(ServeConfig(model="tiny-moe-chat", port=0, api_key=["k1", "k2"], record=str(store)))
    url = f"http://127.0.0.1:{next(gen).cfg.port}"
    status, out = post(url, "/v1/completions", {"prompt": "12+30=", "max_tokens": 4, "metadata": {"trace_id": "t-1"}})
    assert status == 200 and out["trace_id"] == "t-1"
    status, made = post(url, "/v1/completions", {"prompt": "1+1=", "max_tokens": 2})
    assert status == 200 and made["trace_id"].startswith("trace-")  # none given: one is made and returned
    assert post(url, "/v1/feedback", {"trace_id": "t-1", "reward": 1.0})[0] == 200
    assert post(url, "/v1/feedback", {"response_id": made["id"], "reward": 0.0, "label": "thumbs_down"})[0] == 200
    cases = [
        ({"trace_id": "t-1", "reward": 1.0}, "k2", 404, "no trace 't-1' in this key's recorded traffic"),
        ({"trace_id": "nope", "reward": 1.0}, "k1", 404, "no trace 'nope'"),
        (
            {"trace_id": "t-1", "reward": math.nan},
            "k1",
            400,
            "reward must be a finite number in [-1e+06, 1e+06], not nan",
        ),
        ({"trace_id": "t-1", "reward": "good"}, "k1", 400, "not 'good'"),
        ({"trace_id": "t-1", "reward": 10**30}, "k1", 400, "reward must be a finite number in [-1e+06, 1e+06]"),
        ({"trace_id": "t-1", "reward": 1.0, "comment": "\ud800"}, "k1", 400, "comment is not valid Unicode"),
        ({"trace_id": "t-1", "reward": 1.0, "comment": "a\x00b"}, "k1", 400, "comment holds a NUL character"),
        (
            {"trace_id": "t-1", "response_id": made["id"], "reward": 1.0},
            "k1",
            400,
            "one string field: trace_id or response_id",
        ),
        ({"reward": 1.0}, "k1", 400, "one string field: trace_id or response_id"),
        ({"trace_id": "t-1", "reward": 1.0, "label": 7}, "k1", 400, "label must be a string of at most 256 characters"),
    ]
    for body, key, code, message in cases:
        status, out = post(url, "/v1/feedback", body, key=key)
        assert (status, message in out["error"]["message"]) == (code, True), (body, out)
    status, out = post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "x"}, key="k2")
    assert status == 403 and "needs the operator's key (the first --api-key)" in out["error"]["message"]
    status, out = post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "x"}, key="k1")
    assert status == 403 and "adapter loading is disabled" in out["error"]["message"]  # past the operator check
    status, out = post(url, "/v1/completions", {"prompt": "1+1=", "max_tokens": 2, "metadata": {"trace_id": "a b"}})
    assert status == 400 and "a trace id (X-Trace-Id or metadata.trace_id)" in out["error"]["message"]

    held = sqlite3.connect(store, timeout=0)  # another process holds the store's write lock
    held.execute("BEGIN EXCLUSIVE")
    status, out = post(url, "/v1/completions", {"prompt": "2+2=", "max_tokens": 2, "metadata": {"trace_id": "t-2"}})
    assert status == 200 and out["choices"][0]["token_ids"]  # served all the same
    health = json.loads(urllib.request.urlopen(url + "/health").read())["recording"]
    assert health == {"recorded": 2, "failed": 1}  # open to load balancers: counts only
    req = urllib.request.Request(url + "/v1/recording", headers={"Authorization": "Bearer k1"})
    details = json.loads(urllib.request.urlopen(req).read())
    assert "locked" in details["last_error"] and details["store"] == str(store)
    status, out = post(url, "/v1/completions", {"prompt": "2+2=", "max_tokens": 2, "user": "\ud800"})
    assert status == 400 and "user (or metadata.user_id) is not valid Unicode" in out["error"]["message"]
    held.rollback()
    held.close()
    assert post(url, "/v1/completions", {"prompt": "2+2=", "max_tokens": 2, "metadata": {"trace_id": "t-2"}})[0] == 200
    assert json.loads(urllib.request.urlopen(url + "/health").read())["recording"]["recorded"] == 3
    next(gen, None)
    gen = running_server(ServeConfig(model="tiny-moe-chat", port=0))
    status, out = post(
        f"http://127.0.0.1:{next(gen).cfg.port}", "/v1/feedback", {"trace_id": "t-1", "reward": 1.0}, key=None
    )
    assert status == 400 and "start the server with --record STORE" in out["error"]["message"]
    next(gen, None)


def test_traces_command_lists_exports_and_deletes(tmp_path, capsys):
    """`trillora traces` through the CLI's own entry point (`cli.main`, what `python -m trillora` runs)."""
    import pyarrow.parquet as pq

    from trillora.cli import main

    db = tmp_path / "traces.db"
    store = TraceStore(str(db))
    store.record([call("r1", "a", user="alice", created=time.time() - 10 * 86400)])
    store.record([call("r2", "b", user="bob"), call("r2", "b", user="bob", choice=1)])
    store.add_feedback(Feedback("b", "k1", 1.0, label="thumbs_up"))

    def traces(*args: str, code: int = 0) -> str:
        try:
            rc = main(["traces", str(db), *args])
        except SystemExit as e:  # argparse's usage errors
            rc = e.code
        out = capsys.readouterr()
        assert rc == code, out.err
        return out.out if code == 0 else out.err

    assert [json.loads(line)["trace_id"] for line in traces("list", "--json").splitlines()] == ["a", "b"]
    assert "b  user=bob  calls=2  rewards=1  mean_reward=1.000" in traces("list", "--user", "bob")
    assert "exported 2 traces" in traces("export", "--out", str(tmp_path / "t.jsonl"))
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert rows[1]["records"][1]["choice"] == 1 and rows[1]["feedback"][0]["label"] == "thumbs_up"
    assert "owner" not in rows[0]["records"][0] and rows[0]["records"][0]["completion_ids"] == [4, 5]
    traces("export", "--out", str(tmp_path / "t.parquet"), "--older-than", "7d")
    table = pq.read_table(tmp_path / "t.parquet").to_pylist()
    assert [r["trace_id"] for r in table] == ["a"] and table[0]["records"][0]["prompt_ids"] == [1, 2, 3]
    assert "deleted 1 traces" in traces("delete", "--older-than", "7d")
    assert "needs --older-than, --user or --trace" in traces("delete", code=2)
    assert "--older-than 'soon'" in traces("list", "--older-than", "soon", code=2)
    assert [t["trace_id"] for t in TraceStore(str(db)).traces()] == ["b"]


LEARN = """seed = 0
[lora]
rank = 4
targets = ["mlp", "experts"]
[learn]
every = 4
"""


def start_server(store_at: str, state: Path, learn: Path) -> tuple[subprocess.Popen, str]:
    """`trillora serve --record --learn` in its own process."""
    return serve_process(
        [
            "serve",
            "tiny-moe-chat",
            "--api-key",
            "k1",
            "--record",
            store_at,
            "--learn",
            str(learn),
            "--state-dir",
            str(state),
        ]
    )


def current_revision(url: str) -> int:
    req = urllib.request.Request(url + "/v1/revisions", headers={"Authorization": "Bearer k1"})
    return json.loads(urllib.request.urlopen(req, timeout=30).read())["current"] or 0


@pytest.mark.slow
def test_kill_9_under_load_keeps_every_acknowledged_record(store_at, tmp_path):
    """`trillora serve --record --learn` in its own process, 4 clients sending completions and
    feedback while it learns; the server is killed with SIGKILL mid-traffic. Every response and every
    feedback that was answered 200 is in the store afterwards (SQLite: WAL, synchronous=FULL;
    PostgreSQL: a commit per request), and the restarted server's learner serves the last revision
    it had published (written before it was served)."""
    learn = tmp_path / "learn.toml"
    learn.write_text(LEARN)
    proc, url = start_server(store_at, tmp_path / "state", learn)
    acked: list[tuple[str, str]] = []  # (response id, trace id) answered 200
    feedback: list[str] = []  # trace ids whose feedback was answered 200
    stop = threading.Event()

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            trace = f"c{i}-{n}"
            try:
                status, out = post(
                    url, "/v1/completions", {"prompt": f"{i}+{n}=", "max_tokens": 3, "metadata": {"trace_id": trace}}
                )
                if status == 200:
                    acked.append((out["id"], trace))
                    if post(url, "/v1/feedback", {"trace_id": trace, "reward": float(n % 2)})[0] == 200:
                        feedback.append(trace)
            except (OSError, ValueError):  # the server is gone
                return
            n += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    deadline = time.monotonic() + 300
    while (len(acked) < 24 or current_revision(url) < 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    published = current_revision(url)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    stop.set()
    [t.join(60) for t in threads]
    store = TraceStore(store_at)
    for response_id, trace in list(acked):
        assert response_id in {c.response_id for c in store.calls(trace)}, trace
    for trace in list(feedback):
        assert [f.reward for f in store.feedback(trace)] == [float(int(trace.split("-")[1]) % 2)], trace
    assert len(acked) >= 24 and len(feedback) >= 20 and published >= 1
    store.close()
    proc, url = start_server(store_at, tmp_path / "state", learn)
    try:
        assert current_revision(url) >= published  # resumed from the newest revision on disk
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow
def test_the_readme_recording_commands_run_as_written(tmp_path):
    """The README's `serve --record` block in a fresh folder: the server as written (on a free port,
    appended: the last --port wins), two completions and a thumbs-up through its key, then each
    `trillora traces` command as written."""
    import shlex

    from docs_pages import bash_block

    commands = [shlex.split(line) for line in bash_block("Recording served traffic: `serve --record`")]
    assert [c[:2] for c in commands] == [["trillora", "serve"]] + [["trillora", "traces"]] * 3
    trillora = str(Path(sys.executable).parent / "trillora")
    serve = commands[0]
    key = serve[serve.index("--api-key") + 1]
    proc, url = serve_process(serve[1:], cwd=tmp_path)
    try:
        for user in ("alice", "bob"):
            status, out = post(
                url,
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "12+30="}], "max_tokens": 8, "user": user},
                key=key,
            )
            assert status == 200
        assert (
            post(url, "/v1/feedback", {"trace_id": out["trace_id"], "reward": 1.0, "label": "thumbs_up"}, key=key)[0]
            == 200
        )
    finally:
        proc.terminate()
        proc.wait(30)
    outputs = []
    for command in commands[1:]:
        out = subprocess.run([trillora, *command[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (command, out.stderr)
        outputs.append(out.stdout)
    assert outputs[0].count("calls=1") == 2 and "user=bob  calls=1  rewards=1  mean_reward=1.000" in outputs[0]
    assert "exported 2 traces" in outputs[1] and len((tmp_path / "traces.jsonl").read_text().splitlines()) == 2
    assert "deleted 0 traces" in outputs[2]  # nothing is 30 days old yet
