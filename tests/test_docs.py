"""The documentation: the README short, with what a newcomer came for on its first screen; the
docs site built strictly (a broken link or a missing figure fails); the configuration reference
generated from the config dataclasses; and every command block of the README and docs/ run by a
named test, as written or smaller (the registry below), so a new block cannot go untested."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

from docs_pages import PAGES, ROOT

AS_WRITTEN, SMALLER = "as written", "smaller (fewer steps or ranks, a free port)"
BLOCKS = {  # the first command of each ```bash block -> (the test that runs it, how)
    "make demo": ("tests/test_readme_commands.py::test_the_using_it_commands_run_as_written", SMALLER),
    "trillora train examples/jsonl.toml steps=20": (
        "tests/test_readme_commands.py::test_the_three_ways_in_run_as_written",
        AS_WRITTEN,
    ),
    "trillora serve tiny-moe-chat --tinker --api-key tml-local --port 8000": (
        "tests/test_readme_commands.py::test_the_three_ways_in_run_as_written",
        AS_WRITTEN,
    ),
    "trillora plan --model kimi-k2 --gpus 64 --gpu h800 --seq-len 16384 --rollouts 512 --lora-rank 128": (
        "tests/test_readme_commands.py::test_the_three_ways_in_run_as_written",
        AS_WRITTEN,
    ),
    "trillora train": ("tests/test_readme_commands.py::test_the_using_it_commands_run_as_written", AS_WRITTEN),
    "trillora train examples/countdown.toml --resume": (
        "tests/test_resume.py::test_checkpoints_every_k_keep_n_and_a_damaged_one_is_passed_over",
        SMALLER,
    ),
    "trillora serve tiny-moe --port 8000 --adapter-root runs --api-key KEY": (
        "tests/test_serve_openai.py::test_rl_steps_through_the_server",
        SMALLER,
    ),
    "python -m trillora.tiny build-family runs/family": (
        "tests/test_flops.py::test_build_family_pretrains_each_width_for_its_token_budget",
        SMALLER,
    ),
    "trillora serve tiny-moe-chat --record runs/traces.db --api-key KEY": (
        "tests/test_traces.py::test_the_readme_recording_commands_run_as_written",
        AS_WRITTEN,
    ),
    "trillora serve tiny-moe-chat --record runs/traces.db --learn examples/product/learn.toml --api-key KEY": (
        "tests/test_learning.py::test_the_readme_learning_command_runs_as_written",
        AS_WRITTEN,
    ),
    "make setup-vllm": ("tests/test_readme_commands.py::test_the_vllm_command_runs_as_written", AS_WRITTEN),
    "VLLM_SERVER_DEV_MODE=1 TRILLORA_SYNC_DIR=runs/default/sync VLLM_CPU_KVCACHE_SPACE=1 \\": (
        "tests/test_vllm.py::test_rl_steps_against_vllm_server_merged",
        SMALLER,
    ),
    "trillora serve tiny-moe-chat --tinker --api-key tml-local --port 8000    # binds": (
        "tests/test_tinker_service.py::test_the_cli_serves_it",
        SMALLER,
    ),
    "trillora plan --model qwen3-30b-a3b --tinker --gpus 8 --gpu h100 --seq-len 4096 --rollouts 8 --lora-rank 8 "
    "--clients 8": (
        "tests/test_planner.py::test_readme_service_plan_command",
        AS_WRITTEN,
    ),
    "trillora plan --model kimi-k2 --tinker --gpus 64 --gpu h800 --seq-len 4096 --rollouts 64 --lora-rank 8 "
    "--clients 2": (
        "tests/test_planner.py::test_readme_service_plan_for_kimi_k2",
        AS_WRITTEN,
    ),
    "trillora plan --model qwen3-30b-a3b --tinker --gpus 8 --gpu h100 --seq-len 32768 --rollouts 1 --lora-rank 8 "
    "--clients 8": (
        "tests/test_planner.py::test_readme_service_plan_for_a_long_datum",
        AS_WRITTEN,
    ),
    "trillora plan --model kimi-k2 --tinker --gpus 64 --gpu h800 --seq-len 4096 --rollouts 64 --lora-rank 8 "
    "--clients 2 --expert-rank 1": (
        "tests/test_planner.py::test_readme_service_plan_with_divided_expert_rank",
        AS_WRITTEN,
    ),
    "python examples/tinker_cookbook_tiny.py sl log_path=runs/cookbook-sl batch_size=32 max_steps=128 "
    "learning_rate=3e-3": (
        "tests/test_tinker_cookbook.py::test_cookbook_supervised_then_rl_loop_run_unchanged",
        SMALLER,
    ),
    "python benchmarks/context_budget.py --model OUT --fractions 0.5 0.25 --rl-steps 60 --rl-seeds 0 1 2": (
        "tests/test_context.py::test_the_context_budget_benchmark_runs_every_policy",
        SMALLER,
    ),
    "torchrun --nproc-per-node 4 -m trillora serve tiny-moe-chat --tp 2 --ep 2 --record traces.db --learn learn.toml": (
        "tests/test_learning_sharded.py::test_the_cli_learns_under_torchrun_and_rolls_back_on_every_rank",
        SMALLER,
    ),
    "torchrun --nproc-per-node 4 -m trillora train parallel.tp=2 parallel.ep=2": (
        "tests/test_parallel.py::test_torchrun_train_matches_single_process",
        SMALLER,
    ),
}


def blocks() -> list[tuple[str, str]]:
    """(page, first command line) of every ```bash block of the README and docs/."""
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        fence = False
        for i, line in enumerate(lines):
            if line.startswith("```"):
                if not fence and line[3:] == "bash":
                    out.append((page.name, lines[i + 1]))
                fence = not fence
    return out


def registered(first_line: str) -> str | None:
    """The registry key a block's first line starts with (its comment and spacing aside)."""
    matches = [k for k in BLOCKS if first_line.startswith(k) or first_line.split("  #")[0].strip() == k]
    return max(matches, key=len) if matches else None


def test_every_command_block_is_run_by_a_named_test():
    found = blocks()
    assert len(found) >= 15
    unregistered = [(page, line) for page, line in found if registered(line) is None]
    assert not unregistered, f"command blocks no test runs (add a test, then a row to BLOCKS): {unregistered}"
    for test, how in BLOCKS.values():
        path, name = test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), test
        assert how in (AS_WRITTEN, SMALLER)


def test_the_readme_is_short_and_its_first_screen_has_the_two_commands_and_a_picture():
    readme = (ROOT / "README.md").read_text()
    first = "\n".join(readme.splitlines()[:40])
    assert len(readme.splitlines()) <= 220
    assert "make demo" in first and "make test" in first and "![" in first
    for link in re.findall(r"\]\(([^)#]+)\)", readme):  # every page it links to exists
        assert (ROOT / link).exists(), link
    image = re.search(r"!\[[^]]*\]\(([^)]+)\)", first).group(1)
    assert (ROOT / image).stat().st_size > 10_000


def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict` (what `make test` runs): a broken link, a missing figure or a page
    left out of the navigation fails it."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    config = (tmp_path / "site" / "config" / "index.html").read_text()
    assert "learn.gate_traces" in config and "rollout.precision" in config  # generated, not written by hand
    assert (tmp_path / "site" / "results" / "product_loop.png").exists()  # a figure the pages show


def test_the_config_reference_lists_every_key_with_its_docstring():
    from trillora.config import TrainConfig
    from trillora.config.reference import field_docs, markdown

    page = markdown()
    for f in dataclasses.fields(TrainConfig):
        value = getattr(TrainConfig(), f.name)
        if dataclasses.is_dataclass(value):
            for sub in dataclasses.fields(value):
                assert f"| `{f.name}.{sub.name}` |" in page, (f.name, sub.name)
        else:
            assert f"| `{f.name}` |" in page, f.name
    doc = field_docs(type(TrainConfig().learn))["holdout"]
    assert doc.startswith('With `gate = "traces"`: the share of traces') and doc in page
    assert (
        "| `lora.targets` | tuple | `('mlp', 'shared_experts', 'experts')` |" in page
    )  # the run's default, not LoraConfig's


@dataclasses.dataclass(kw_only=True, frozen=True)
class _Section:
    added: int = 3
    """A key added to a section: on the page with no edit anywhere else."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class _Config:
    steps: int = 1
    section: _Section = dataclasses.field(default_factory=_Section)


def test_a_new_key_shows_up_without_a_hand_edit():
    from trillora.config.reference import markdown

    page = markdown(_Config)
    assert "## [section]" in page
    assert "| `section.added` | int | `3` | A key added to a section: on the page with no edit anywhere else. |" in page
    assert "| `steps` | int | `1` |  |" in page
    assert Path(ROOT / "docs" / "config.md").read_text().count("<!-- generated: trillora.config.reference -->") == 1


def test_the_config_page_holds_the_current_reference():
    """docs/config.md's copy (what GitHub shows) is the reference the code gives now."""
    from trillora.config.reference import filled

    page = (ROOT / "docs" / "config.md").read_text()
    assert filled(page) == page, "run: python -m trillora.config.reference --write docs/config.md"


def test_both_serving_pages_list_every_budget_its_flag_and_default():
    """docs/product-loop.md and docs/tinker.md hold the budget table `ServeConfig` gives now; every
    `max_*` field is in it, with the default the server starts with."""
    import dataclasses
    import importlib.util

    from trillora.serve.config import BUDGETS, ServeConfig

    spec = importlib.util.spec_from_file_location("hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    fields = {f.name: f for f in dataclasses.fields(ServeConfig)}
    assert {n for n in fields if n.startswith("max_")} <= set(BUDGETS)
    defaults = ServeConfig(model="tiny-moe")
    for name in ("product-loop.md", "tinker.md"):
        page = (ROOT / "docs" / name).read_text()
        assert hooks.generated(page) == page, "run: python docs/hooks.py"
        for budget in BUDGETS:
            assert f"| `--{budget.replace('_', '-')}` | `{getattr(defaults, budget)!r}` |" in page, (name, budget)


def test_the_api_pages_first_script_runs_as_written(tmp_path):
    import subprocess
    import sys

    page = (ROOT / "docs" / "api.md").read_text()
    script = page.split("```python\n", 1)[1].split("\n```", 1)[0]
    (tmp_path / "first.py").write_text(script)
    out = subprocess.run([sys.executable, "first.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
