"""The registers env: the ledger's turns with another shape of what must be kept (writes that
overwrite each other, all of one form), its warm-up rows and its run through the memory benchmark."""

from __future__ import annotations

import random
import re

import pytest

from trillora.checkpoint import load_tokenizer
from trillora.envs.ledger import LedgerEnv
from trillora.envs.registers import dataset, episode


def writes(lines: list[str]) -> list[list[tuple[str, int]]]:
    return [[(p[0], int(p[2])) for p in line.split()] for line in lines]


def test_the_asked_register_is_last_written_early_and_an_older_write_is_stale():
    for seed in range(50):
        lines, key, value = episode(random.Random(seed), turns=8, writes=3, count=5, asked_from=2)
        per_turn = writes(lines)
        assert len(lines) == 8 and all(len(w) == 3 and len({k for k, _ in w}) == 3 for w in per_turn)
        assert all(re.fullmatch(r"[a-z]=\d( [a-z]=\d){2}", line) for line in lines)  # one form: no distractor case
        asked = [(turn, v) for turn, w in enumerate(per_turn, 1) for k, v in w if k == key]
        # written at turn 1 and last at turn 2 with another value; never after
        assert [t for t, _ in asked] == [1, 2] and asked[0][1] != asked[1][1] == value
        assert len({k for w in per_turn for k, _ in w}) == 5  # five registers, the others rewritten
    # a longer early phase: the last write anywhere in 2..asked_from, each write another value than the last
    lasts = set()
    for seed in range(60):
        lines, key, value = episode(random.Random(seed), turns=8, writes=2, count=4, asked_from=5)
        asked = [(turn, v) for turn, w in enumerate(writes(lines), 1) for k, v in w if k == key]
        assert asked[0][0] == 1 and asked[-1] == (asked[-1][0], value) and asked[-1][0] <= 5
        assert all(a[1] != b[1] for a, b in zip(asked, asked[1:], strict=False))
        lasts.add(asked[-1][0])
    assert lasts == {2, 3, 4, 5}


def test_the_env_rewards_the_last_write_not_the_stale_one():
    tok = load_tokenizer("tiny-moe")
    lines, key, value = episode(random.Random(3), 8, 3, 5, 2)
    stale = next(v for k, v in writes(lines)[0] if k == key)
    ok = tok("ok", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def answer(digit: int) -> float:
        env = LedgerEnv(lines, key, value, tok)
        env.initial_observation()
        for _ in range(len(lines) + 1):
            seen = env.step(ok).next_observation
        assert tok.decode(seen).endswith(f"{lines[-1]}\nok<eos>\n{key}?")
        return env.step(tok(str(digit), add_special_tokens=False)["input_ids"]).reward

    assert stale != value and answer(value) == 1.0 and answer(stale) == 0.0
    ds = dataset(tok, batch_size=2, group_size=3, eval_size=4, seed=1)
    assert [g.lines for g in ds.get_batch(5)] == [g.lines for g in ds.get_batch(5)] and len(ds.eval_batch()) == 4
    assert ds.get_batch(0)[0].lines != dataset(tok, 2, 3, 4, 2).get_batch(0)[0].lines  # the seed counts
    with pytest.raises(ValueError, match="1 <= writes < registers <= 26 .* writes=5, registers=5"):
        dataset(tok, 1, 1, 1, 0, writes=5, registers=5)
    with pytest.raises(ValueError, match="asked_from >= 2 .* asked_from=1"):  # the asked register is written twice
        dataset(tok, 1, 1, 1, 0, asked_from=1)


def test_warm_up_rows_for_the_registers_keep_only_last_writes():
    """The refill target drops a write that a later one in the span overwrites (a no-op on the
    ledger, whose keys are written once); the transcript's extra questions are answered with each
    register's last value."""
    from trillora.tiny.memory import transcript
    from trillora.tiny.memory_rows import kept_facts, refill_rows

    assert kept_facts("c=4 d=2\nok<eos>\nc=5 e=1\n", 20) == "d=2 c=5 e=1"
    assert kept_facts("c=4 d=2\nok<eos>\nc=5 e=1\n", 7) == "d=2 c=5"
    tok = load_tokenizer("tiny-moe")
    for seed in range(5):
        for ids, mask in refill_rows(tok, random.Random(seed), env_name="registers"):
            prompt = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
            target = tok.decode([t for t, m in zip(ids, mask, strict=True) if m]).removesuffix("<eos>")
            span = prompt[prompt.rfind("[[") + 2 : prompt.rfind("]]")]
            keys = [f[0] for f in target.split()]
            assert len(keys) == len(set(keys)) and all(f in span for f in target.split())
    # with the context after the span in the prompt, a register written again there is left out
    for seed in range(5):
        for ids, mask in refill_rows(tok, random.Random(seed), env_name="registers", refill_context=True):
            prompt = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
            target = tok.decode([t for t, m in zip(ids, mask, strict=True) if m]).removesuffix("<eos>")
            span, after = prompt[prompt.rfind("[[") + 2 : prompt.rfind("]]")], prompt[prompt.rfind("]]") + 2 :]
            budget = int(re.search(r"\n(\d+):\n$", after).group(1))
            assert target == kept_facts(span, budget, after) and len(target) <= budget
            assert not {f[0] for f in target.split()} & set(re.findall(r"([a-z])=\d", after))
    ids, mask = transcript(tok, random.Random(11), env_name="registers")
    text = tok.decode(ids)
    written = dict(p.split("=") for p in re.findall(r"(?<![a-z?])[a-z]=\d", text))  # the last write of each
    asked = re.findall(r"\n([a-z])\?(\d)<eos>", text)
    assert len(asked) == len(written) and all(written[k] == v for k, v in asked)


@pytest.mark.slow
def test_the_context_budget_benchmark_runs_the_registers(tmp_path):
    """The benchmark is generic over envs: `--config examples/registers.toml` plays the registers
    under every policy (no RL here: the ledger's test trains)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "reg.json"
    run = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "context_budget.py"), "--config", "examples/registers.toml"]
        + ["--model", "tiny-moe", "--seeds", "0", "--episodes", "3", "--fractions", "0.5", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["env"]["env"] == "trillora.envs.registers:dataset" and report["diffusion"]["budget"] == 70
    assert {r["policy"] for r in report["rows"]} == {"truncate", "retrieval", "summary", "diffusion"}
    assert report["episode_tokens"] > 100  # 8 lines of 3 writes
    assert "registers success" in run.stdout and out.with_suffix(".png").exists()
    png = out.with_suffix(".png")
    png.unlink()  # --replot draws it again from the results file alone
    again = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "context_budget.py"), "--replot", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", again.stderr[-2000:]
