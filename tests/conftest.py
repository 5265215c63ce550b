"""Shared fixtures: a small training run that finishes in seconds on 2 cores."""

from __future__ import annotations

import pytest
import torch

from trillora.config import TrainConfig, load_config


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run where there is a CUDA device and are skipped, saying so, elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SMALL_RUN = (
    "steps=2",
    "eval_every=2",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "task.eval_problems=8",
    "task.eval_samples=1",
    'task.retention=""',
)
"""A run of the default job small enough for a test: 2 steps of 4 prompts × 4 samples, 8 held-out
problems, no retention task. Later overrides win."""


@pytest.fixture
def small_config(tmp_path):
    """`small_config(*overrides, name="run")`: the small run's config writing under tmp_path."""

    def make(*overrides: str, name: str = "run") -> TrainConfig:
        return load_config(None, [f"out_dir={tmp_path}", f"name={name}", *SMALL_RUN, *overrides])

    return make
