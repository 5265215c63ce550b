"""The chat model's pretraining data and start: earlier exchanges within their budget and
correct, and the start from tiny-moe's weights with the grown vocabulary's new rows left alone."""

from __future__ import annotations

import random

import pytest
import torch

from trillora.checkpoint import load_model, resolve_model_path
from trillora.models import build_model, from_hf_config
from trillora.tiny import TINY_QWEN3_MOE, build_chat_tokenizer
from trillora.tiny.chat import history, init_from_base


def test_history_fills_its_budget_with_correct_exchanges():
    rng = random.Random(0)
    for chars in (0, 50, 200, 440):
        turns = history(rng, chars)
        assert sum(len(m["content"]) + 16 for m in turns) <= chars
        assert [m["role"] for m in turns] == ["user", "assistant"] * (len(turns) // 2)
        for ask, say in zip(turns[::2], turns[1::2], strict=True):
            q, a = ask["content"], say["content"]
            if "+" in q:
                x, y = q.rstrip("=").split("+")
                assert a == str(int(x) + int(y))
            elif q.startswith("reverse "):
                assert a == q.removeprefix("reverse ")[::-1]
            else:  # "How many x's are in word? Count them." -> "... x is at 2, 5: 2."
                letter, word = q.split("'")[0][-1], q.split(" in ")[1].split("?")[0]
                assert a.endswith(f": {word.count(letter)}.")
    assert len(history(random.Random(1), 440)) >= 4  # a long budget holds several exchanges


def test_the_chat_model_starts_from_tiny_moe_with_new_rows_untouched():
    tok = build_chat_tokenizer()
    config = dict(
        TINY_QWEN3_MOE,
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = build_model(from_hf_config(config, where="test"), device="cpu")
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(0))
    fresh = model.lm_head.weight.detach().clone()
    init_from_base(model, resolve_model_path("tiny-moe"))
    base = dict(load_model(resolve_model_path("tiny-moe")).named_parameters())
    v = base["lm_head.weight"].shape[0]
    assert len(tok) == v + 6  # two turn markers, four tool-call markers
    assert torch.equal(model.lm_head.weight[:v], base["lm_head.weight"])
    assert torch.equal(model.lm_head.weight[v:], fresh[v:])
    for name, p in model.named_parameters():
        if p.shape == base[name].shape:
            assert torch.equal(p, base[name]), name


@pytest.mark.slow
def test_build_chat_runs_its_training_loop(tmp_path):
    """`python -m trillora.tiny build-chat OUT`: the supervised loop (rows padded by `pad_rows`, loss
    on the assistant's tokens) runs and writes a loadable checkpoint with its report."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "trillora.tiny", "build-chat", str(tmp_path / "c"), "--max-steps", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "c" / "pretrain_report.json").read_text())
    assert report["steps"] == 2 and load_model(tmp_path / "c").args.vocab_size > 0
