"""Adding a model family takes its folder and one registry line: a renamed copy of
`models/qwen3_moe/`, registered under a model_type transformers has never heard of, loads a
transformers Qwen3-MoE checkpoint with the same logits and trains a LoRA step."""

from __future__ import annotations

import filecmp
import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hf_models import QWEN3_MOE, hf_model, tokens

import trillora
from trillora import lora
from trillora.checkpoint import resolve_model_path
from trillora.models import ConfigError, from_hf_config, registry
from trillora.trainer import Trainer

MODELS = Path(trillora.models.__file__).parent


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """`models/toy_moe/`: qwen3_moe's folder with its `FAMILY` renamed, nothing else changed."""
    folder = tmp_path / "families" / "toy_moe"
    shutil.copytree(MODELS / "qwen3_moe", folder, ignore=shutil.ignore_patterns("__pycache__"))
    init = folder / "__init__.py"
    text = init.read_text()
    for old, new in (
        ('name="qwen3_moe"', 'name="toy_moe"'),
        ('model_types=("qwen3_moe", "qwen3")', 'model_types=("toy_moe",)'),
        ('{"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen3ForCausalLM": "qwen3"}', '{"ToyMoeForCausalLM": "toy_moe"}'),
    ):
        assert old in text, old
        text = text.replace(old, new)
    init.write_text(text)
    differ = filecmp.dircmp(MODELS / "qwen3_moe", folder, ignore=["__pycache__"])
    assert differ.diff_files == ["__init__.py"] and not differ.left_only and not differ.right_only
    monkeypatch.setattr(trillora.models, "__path__", [*trillora.models.__path__, str(folder.parent)])
    family = importlib.import_module("trillora.models.toy_moe").FAMILY
    registry.register(family)  # the one registry line
    yield family
    del registry.FAMILIES["toy_moe"], registry.MODEL_TYPES["toy_moe"]
    for name in [n for n in sys.modules if n.startswith("trillora.models.toy_moe")]:
        del sys.modules[name]


def as_toy(folder: Path) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="toy_moe", architectures=["ToyMoeForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_new_family_loads_and_matches_transformers(toy_family, tmp_path):
    reference = hf_model(QWEN3_MOE)
    ids = tokens(reference.config.vocab_size)
    with torch.no_grad():
        want = reference(ids).logits
    reference.save_pretrained(tmp_path / "hf")
    model = trillora.load_model(as_toy(tmp_path / "hf"))
    assert model.args.family == "toy_moe" and model.args.model_type == "toy_moe"
    with torch.no_grad():
        assert (model(ids) - want).abs().max().item() <= 1e-4


def test_a_new_family_trains_a_lora_step(toy_family, tmp_path, small_config):
    checkpoint = as_toy(Path(shutil.copytree(resolve_model_path("tiny-moe"), tmp_path / "toy")))
    cfg = small_config(f"model.path={checkpoint}", "steps=1", "eval_every=1")
    trainer = Trainer(cfg)
    trainer.run()
    assert trainer.model.args.family == "toy_moe"
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and rows[-1]["grad_norm"] > 0
    fresh = trillora.load_model(checkpoint)
    lora.load_adapter(fresh, cfg.run_dir / "adapter" / "fused")
    moved = [n for n, p in lora.lora_parameters(fresh) if n.endswith("_B") and p.abs().max() > 0]
    assert moved  # B starts at zero: the step changed the adapter


def test_a_model_type_is_read_by_one_family(toy_family):
    clash = type(toy_family)(
        name="other", model_types=("toy_moe",), architectures={}, parse=toy_family.parse, build=toy_family.build
    )
    with pytest.raises(ConfigError, match="'toy_moe' is already read by family 'toy_moe'"):
        registry.register(clash)
    assert from_hf_config(dict(QWEN3_MOE, model_type="toy_moe")).family == "toy_moe"
