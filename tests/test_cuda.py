"""On a CUDA device (skipped without one): the shipped model gives the CPU's logits there, and the
small run of the default job trains there end to end (local engine, update, adapter export)."""

from __future__ import annotations

import json

import pytest
import torch

from trillora.checkpoint import load_model, resolve_model_path
from trillora.trainer import Trainer

pytestmark = pytest.mark.gpu


def test_the_tiny_moe_gives_the_cpu_logits_on_cuda():
    model = load_model(resolve_model_path("tiny-moe"))
    ids = torch.tensor([[1, 5, 6, 7, 76, 8, 9, 10, 84], [1, 12, 13, 76, 14, 15, 84, 16, 17]])
    with torch.no_grad():
        want = model(ids)
        got = model.to("cuda")(ids.to("cuda")).cpu()
    assert (got - want).abs().max().item() < 1e-4


def test_the_small_run_trains_on_cuda(small_config):
    cfg = small_config("device=cuda")
    trainer = Trainer(cfg)
    summary = trainer.run()
    assert next(trainer.model.parameters()).device.type == "cuda"
    assert summary["steps_done"] == 2 and summary["skipped_updates"] == 0
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(r["grad_norm"] > 0 for r in rows)
    assert (cfg.run_dir / "adapter" / "fused" / "adapter_model.safetensors").exists()
