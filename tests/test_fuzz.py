"""Property-based fuzzing: the config loader, the JSONL loader and the answer parsers either
succeed or raise their own named error — never a stray exception."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trillora.config import ConfigError, TrainConfig, load_config
from trillora.tasks import ArithmeticTask, CountdownTask, DatasetError, Problem, evaluate
from trillora.tasks.jsonl import read_rows

KEYS = st.sampled_from(
    [
        "steps",
        "seed",
        "name",
        "lora.rank",
        "lora.targets",
        "rollout.temperature",
        "rollout.top_p",
        "algorithm.mismatch",
        "algorithm.mismatch_band",
        "task.options",
        "optim.lr",
        "nope",
        "lora.nope",
        "a.b.c",
    ]
)
VALUES = st.one_of(
    st.integers(-5, 50),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=12),
    st.lists(st.floats(0, 5), max_size=3),
    st.just('["attention"]'),
    st.just("{}"),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(KEYS, VALUES), max_size=4))
def test_config_loader_fuzz(pairs):
    overrides = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in pairs]
    try:
        cfg = load_config(None, overrides)
    except ConfigError as e:
        assert str(e)
    else:
        assert isinstance(cfg, TrainConfig)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.one_of(
            st.text(max_size=30),
            st.dictionaries(st.text(max_size=6), st.one_of(st.text(max_size=6), st.integers()), max_size=3).map(
                json.dumps
            ),
        ),
        max_size=5,
    )
)
def test_jsonl_loader_fuzz(tmp_path, lines):
    path = tmp_path / "fuzz.jsonl"
    path.write_text("\n".join(line.replace("\n", " ") for line in lines) + "\n")
    try:
        rows, lines, skipped = read_rows(path, "prompt")
    except DatasetError as e:
        assert str(e).startswith(str(path))
    else:
        assert all(isinstance(r["prompt"], str) and r["prompt"].strip() for r in rows) and not skipped
        assert len(lines) == len(rows) and lines == sorted(lines)
    try:  # skip-and-count: only an empty result may raise, and every skipped row names file and line
        rows, _, skipped = read_rows(path, "prompt", bad_rows="skip")
    except DatasetError as e:
        assert str(e).startswith(f"{path}: no rows")
    else:
        assert all(s.startswith(f"{path}:") for s in skipped) and rows


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_answer_parsers_never_raise(text):
    result = evaluate(text)
    assert result is None or (isinstance(result[0], int) and all(isinstance(n, int) for n in result[1]))
    countdown = Problem(prompt="3 5 7>22:", answer="3*5+7", data={"numbers": [3, 5, 7], "target": 22})
    assert CountdownTask().reward(countdown, text) in (0.0, 1.0)
    assert ArithmeticTask().reward(Problem(prompt="1+2=", answer="3"), text) in (0.0, 1.0)
