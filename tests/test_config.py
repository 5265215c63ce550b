"""The run config: TOML + key=value overrides, validation that names the key, round trip."""

from __future__ import annotations

import pytest

from trillora.config import ConfigError, TrainConfig, load_config, to_toml


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(
        None, ["rollout.temperature=0.8", "lora.rank=16", 'lora.targets=["attention", "experts"]', "name=x"]
    )
    assert cfg.rollout.temperature == 0.8 and cfg.lora.rank == 16 and cfg.lora.targets == ("attention", "experts")
    assert load_config() == TrainConfig()
    f = tmp_path / "run.toml"
    f.write_text('steps = 3\n[task]\nname = "countdown"\noptions = {}\n[algorithm]\nmismatch = "seq_tis"\n')
    cfg = load_config(f, ["steps=4"])
    assert (cfg.steps, cfg.task.name, cfg.algorithm.mismatch) == (4, "countdown", "seq_tis")


def test_round_trip_through_toml(tmp_path):
    cfg = load_config(None, ["lora.expert_rank=4", "algorithm.mismatch_band=[0.25, 4.0]", "optim.lr=1e-3"])
    f = tmp_path / "resolved.toml"
    f.write_text(to_toml(cfg))
    assert load_config(f) == cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.temprature=1"], "unknown config key 'rollout.temprature'; did you mean 'rollout.temperature'?"),
        (["stepz=3"], "unknown config key 'stepz'; did you mean 'steps'?"),
        (["lora.rank=x"], "lora.rank: expected int, got str 'x'"),
        (["steps=1.5"], "steps: expected int, got float 1.5"),
        (["algorithm.mismatch=tis"], "algorithm.mismatch='tis' is invalid; allowed: none, token_tis"),
        (["task.name=chess"], "task.name='chess' is invalid; allowed: arithmetic, countdown, reversal, jsonl"),
        (["lora.rank=0"], "lora.rank=0 is invalid; allowed: a positive integer"),
        (["rollout.temperature=0"], "rollout.temperature=0.0 is invalid; RL samples need > 0"),
        (["algorithm.mismatch_band=[2.0, 3.0]"], "need 0 < low < 1 < high"),
        (["rollout=3"], "rollout: expected a table"),
        (["steps"], "must look like key=value"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(
        ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")
    ):
        load_config(None, overrides)


def test_bad_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    f = tmp_path / "bad.toml"
    f.write_text("steps = \n")
    with pytest.raises(ConfigError, match=r"bad.toml: .*line 1"):
        load_config(f)


def test_example_configs_load_and_build_their_tasks():
    from pathlib import Path

    from trillora.tasks import make_task

    root = Path(__file__).resolve().parents[1]
    examples = sorted((root / "examples").glob("*.toml"))
    assert len(examples) >= 3
    for path in examples:
        cfg = load_config(path)
        options = dict(cfg.task.options)
        if "path" in options:
            options["path"] = str(root / options["path"])
        if cfg.task.name == "env":  # user envs: the dataset loads and gives a step's groups of envs
            from trillora.checkpoint import SHIPPED_CHECKPOINTS, load_tokenizer
            from trillora.envs.env_dataset import load_env_dataset
            from trillora.tasks.base import load_callable

            if cfg.model.path not in SHIPPED_CHECKPOINTS and not Path(cfg.model.path).exists():  # a real model's path
                load_callable(options["env"], "env dataset")
                continue

            r = cfg.rollout
            envs = load_env_dataset(
                options,
                tokenizer=load_tokenizer(cfg.model.path),
                batch_size=r.prompts_per_step,
                group_size=r.group_size,
                eval_size=cfg.task.eval_problems,
                seed=cfg.seed,
            )
            groups = envs.get_batch(0)
            assert len(groups) == r.prompts_per_step and len(groups[0].make_envs()) == r.group_size, path.name
            continue
        task = make_task(cfg.task.name, **options)
        problem = task.problems("train", 1, seed=0)[0]
        assert task.reward(problem, problem.answer) == 1.0, path.name


def test_fixed_length_and_finite_values():
    with pytest.raises(ConfigError, match=r"algorithm.mismatch_band: expected a list of 2 values, got 0"):
        load_config(None, ["algorithm.mismatch_band=[]"])
    with pytest.raises(ConfigError, match="rollout.temperature: expected a finite number, got nan"):
        load_config(None, ["rollout.temperature=nan"])


def test_the_context_defaults_to_the_models_positions_and_more_is_refused():
    from trillora.config import load_config
    from trillora.errors import ConfigError
    from trillora.trainer.loop import fit_context

    cfg = load_config(None, [])
    assert cfg.rollout.max_model_len == 0 and fit_context(cfg, 512).rollout.max_model_len == 512
    assert fit_context(load_config(None, ["rollout.max_model_len=300"]), 512).rollout.max_model_len == 300
    with pytest.raises(ConfigError, match=r"rollout.max_model_len=1024 is over the model's 512 positions .*tiny-moe"):
        fit_context(load_config(None, ["rollout.max_model_len=1024"]), 512)


def test_retention_auto_is_reversal_for_a_shipped_model_on_a_built_in_task_only():
    from trillora.trainer.evaluate import retention_task

    decided = {
        (name, model): retention_task(load_config(None, [f"task.name={name}", f"model.path={model}"]))
        for name in ("arithmetic", "countdown", "reversal", "jsonl")
        for model in ("tiny-moe", "tiny-moe-chat", "/models/my-moe")
    }
    assert decided[("arithmetic", "tiny-moe")] == decided[("countdown", "tiny-moe-chat")] == "reversal"
    assert decided[("jsonl", "tiny-moe")] == decided[("reversal", "tiny-moe")] == ""
    assert decided[("arithmetic", "/models/my-moe")] == ""
    asked = load_config(None, ["task.name=jsonl", "task.retention=reversal"])
    assert retention_task(asked) == "reversal"  # asked for: kept
