"""A tokenizer shipped as code (Kimi K2's layout: `tiktoken.model`, `tokenization_kimi.py`,
`auto_map` in tokenizer_config.json), on a folder of the same layout built for the tests
(`tests/data/kimi_tokenizer`, our own small BPE): refused until the user allows the code, then
equal to tiktoken itself on the same file."""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import pytest

from trillora.checkpoint import load_tokenizer
from trillora.checkpoint.hf import CheckpointError

FOLDER = Path(__file__).parent / "data" / "kimi_tokenizer"


def test_tokenizer_code_runs_only_when_allowed(tmp_path):
    folder = shutil.copytree(FOLDER, tmp_path / "kimi")
    with pytest.raises(
        CheckpointError,
        match=r"tokenizer_config.json: the tokenizer is code \(tokenization_kimi.py, "
        r"auto_map.AutoTokenizer\); read it, then allow it with model.trust_remote_code=true \(train\) "
        r"or --trust-remote-code \(serve, eval, generate\)",
    ):
        load_tokenizer(folder)


def test_tiktoken_tokenizer_equals_tiktoken_on_its_own_file(tmp_path):
    import tiktoken

    folder = shutil.copytree(FOLDER, tmp_path / "kimi")
    tok = load_tokenizer(folder, trust_remote_code=True)
    import importlib.util

    spec = importlib.util.spec_from_file_location("kimi_layout", folder / "tokenization_kimi.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lines = (folder / "tiktoken.model").read_text().split("\n")
    ranks = {base64.b64decode(t): int(r) for t, r in (line.split() for line in lines if line.strip())}
    specials = {s: len(ranks) + i for i, s in enumerate(module.SPECIALS)}
    oracle = tiktoken.Encoding("oracle", pat_str=module.PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    for text in ["the 123 cat", "Then they entered 12345 rooms.\n", "naïve café ☕"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == oracle.encode(text) and tok.decode(ids) == text
    assert len(tok("the")["input_ids"]) == 1 and tok.eos_token_id == specials["[EOS]"]
    chat = tok.apply_chat_template([{"role": "user", "content": "the 12"}], add_generation_prompt=True, tokenize=False)
    ids = tok(chat, add_special_tokens=False)["input_ids"]
    assert ids[0] == specials["<|im_start|>"] and oracle.decode(ids) == chat


def test_train_config_takes_the_option(tmp_path):
    from trillora.config import load_config

    assert load_config(None, ["model.trust_remote_code=true"]).model.trust_remote_code is True
    assert load_config(None, []).model.trust_remote_code is False


@pytest.mark.slow
def test_the_commands_take_the_option(tmp_path):
    """A checkpoint folder whose tokenizer is code: `generate` refuses it until told, and both
    server loads it with the option."""
    import json
    import subprocess
    import sys

    import torch

    from trillora import save_model
    from trillora.checkpoint import resolve_model_path
    from trillora.models import build_model, from_hf_config
    from trillora.serve.config import ServeConfig
    from trillora.serve.tinker.service import TinkerService

    config = json.loads((resolve_model_path("tiny-moe") / "config.json").read_text())
    config["vocab_size"] = 288  # the test tokenizer's 276 ids, padded
    model = build_model(from_hf_config(config, where="test"), device="cpu")
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(0))
    folder = save_model(model, tmp_path / "model")
    for f in FOLDER.iterdir():
        shutil.copy(f, folder / f.name)
    cmd = [sys.executable, "-m", "trillora", "generate", str(folder), "--prompt", "the 12", "--max-new-tokens", "3"]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--trust-remote-code" in refused.stderr
    small = tmp_path / "small"  # tiny-moe's 100-row vocabulary with this 276-id tokenizer
    shutil.copytree(folder, small)
    shutil.copy(resolve_model_path("tiny-moe") / "config.json", small / "config.json")
    shutil.copy(resolve_model_path("tiny-moe") / "model.safetensors", small / "model.safetensors")
    mismatch = subprocess.run(
        [*cmd[:4], str(small), *cmd[5:], "--trust-remote-code"], capture_output=True, text=True, timeout=300
    )
    assert (
        mismatch.returncode == 2 and "the tokenizer has 276 tokens but the model's vocab_size is 100" in mismatch.stderr
    )
    allowed = subprocess.run(cmd + ["--trust-remote-code"], capture_output=True, text=True, timeout=300)
    assert allowed.returncode == 0 and allowed.stdout.startswith("the 12"), allowed.stderr
    service = TinkerService(ServeConfig(model=str(folder), state_dir=str(tmp_path / "state"), trust_remote_code=True))
    assert service.tokenizer("the")["input_ids"] == load_tokenizer(FOLDER, trust_remote_code=True)("the")["input_ids"]
