"""Tasks: exact rewards by hand, disjoint splits, dataset errors naming file and line."""

from __future__ import annotations

import json

import pytest

from trillora.tasks import ArithmeticTask, CountdownTask, DatasetError, JsonlTask, Problem, ReversalTask, evaluate


def test_arithmetic_reward_and_splits():
    task = ArithmeticTask(digits=3)
    p = Problem(prompt="123+456=", answer="579")
    assert task.reward(p, "579") == 1.0 and task.reward(p, " 579\nextra") == 1.0
    assert task.reward(p, "578") == 0.0 and task.reward(p, "") == 0.0 and task.reward(p, "5790") == 0.0
    train = {q.prompt for q in task.problems("train", 500, seed=0)}
    held = {q.prompt for q in task.problems("eval", 200, seed=1)}
    assert not train & held
    assert all(str(eval(q.prompt[:-1])) == q.answer for q in task.problems("eval", 50, 0))
    assert task.problems("train", 5, seed=3) == task.problems("train", 5, seed=3)
    with pytest.raises(ValueError, match="allowed: '\\+', '-', '\\*'"):
        ArithmeticTask(ops=("/",))


def test_countdown_reward_by_hand():
    task = CountdownTask()
    p = Problem(prompt="3 5 7>22:", answer="3*5+7", data={"numbers": [3, 5, 7], "target": 22})
    assert task.reward(p, "3*5+7") == 1.0 and task.reward(p, "7+5*3") == 1.0 and task.reward(p, "(7+5)*3-14") == 0.0
    assert task.reward(p, "3*5+7+0") == 0.0  # uses a number not given
    assert task.reward(p, "5*3+7\n") == 1.0
    assert task.reward(p, "22") == 0.0 and task.reward(p, "3*5+") == 0.0 and task.reward(p, "__import__('os')") == 0.0
    assert evaluate("(1+2)*3") == (9, [1, 2, 3]) and evaluate("2**8") is None and evaluate("1/2") is None
    for q in task.problems("train", 50, 0):  # generated problems are solvable by their own answer
        assert task.reward(q, q.answer) == 1.0


def test_reversal():
    task = ReversalTask()
    for q in task.problems("eval", 20, 0):
        word = q.prompt[4:-1]
        assert q.answer == word[::-1] and task.reward(q, q.answer) == 1.0


def test_jsonl_task(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) for i in range(200)) + "\n")
    task = JsonlTask(path=str(data), reward_fn="reward_fns:exact")
    probs = task.problems("train", 10, 0)
    assert all(task.reward(p, p.answer) == 1.0 for p in probs) and task.reward(probs[0], "x") == 0.0
    assert not {p.prompt for p in task.problems("train", 300, 0)} & {p.prompt for p in task.problems("eval", 50, 0)}


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "a"}\n{"prompt": \n', "d.jsonl:2: invalid JSON"),
        ('{"prompt": "a"}\n\n[1, 2]\n', "d.jsonl:3: a row must be a JSON object, got list"),
        ('{"prompt": ""}\n', "d.jsonl:1: missing or empty string field 'prompt'"),
        ("\n\n", "d.jsonl: no rows"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, content, message):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(DatasetError, match=message):
        JsonlTask(path=str(tmp_path / "d.jsonl"), reward_fn="reward_fns:exact")


def test_reward_fn_spec_errors(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a"}\n')
    for spec, msg in [
        ("reward_fns", "must be given as 'module:function'"),
        ("reward_fns:nope", "cannot be imported"),
        ("reward_fns:NOT_CALLABLE", "is not callable"),
    ]:
        with pytest.raises(ValueError, match=msg):
            JsonlTask(path=str(tmp_path / "d.jsonl"), reward_fn=spec)


def test_an_unknown_task_option_is_named_with_the_allowed_ones():
    """A misspelt `task.options` key is a ConfigError naming it and what the task takes, not a
    TypeError traceback from the task's constructor."""
    import pytest

    from trillora.errors import ConfigError
    from trillora.tasks import make_task

    with pytest.raises(
        ConfigError,
        match="task.options for task 'jsonl': unknown key 'pathh'; allowed: path, reward_fn, "
        "prompt_key, answer_key, messages_key, split, bad_rows, name",
    ):
        make_task("jsonl", pathh="data.jsonl")
    with pytest.raises(ConfigError, match="unknown key 'digitz'; allowed: digits, ops, name"):
        make_task("arithmetic", digitz=3)


def test_a_reward_module_beside_the_run_is_found_as_the_console_script_runs(tmp_path, monkeypatch):
    """`trillora train` (a console script) does not put the working folder on sys.path, `python -m`
    does: a `module:function` beside the run is found either way."""
    import sys

    from trillora.tasks.base import load_callable

    (tmp_path / "my_reward_beside.py").write_text("def score(completion, row):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_callable("my_reward_beside:score", "reward function")("x", {}) == 1.0


@pytest.mark.parametrize("env", ["guessing", "ledger", "marathon", "calculator", "python_tool"])
def test_configs_naming_the_built_in_envs_under_tasks_still_load(env):
    """The built-in envs moved from `trillora.tasks` to `trillora.envs`; a config value written before
    the move names the same function."""
    import importlib

    from trillora.tasks.base import load_callable

    assert (
        load_callable(f"trillora.tasks.{env}:dataset", "env dataset")
        is importlib.import_module(f"trillora.envs.{env}").dataset
    )
