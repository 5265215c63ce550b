"""What a run leaves at its end on rank 0: the adapter in both layouts (or the whole model after
full-parameter training), the plots, and `summary.json`."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from torch import nn

from .. import lora
from ..checkpoint import resolve_model_path, save_model
from ..checkpoint.hf import EXPERT_LAYOUTS, HUB_ID
from ..checkpoint.weights import base_fingerprint
from ..config import TrainConfig
from ..policy.world import World
from .report import RunReport
from .update import PolicyUpdate


class Trainer(Protocol):
    """What a finished run's outputs read of `loop.Trainer` (rank 0)."""

    cfg: TrainConfig
    console: Console
    full: nn.Module
    tokenizer: Any
    task: Any
    world: World
    update: PolicyUpdate
    report: RunReport
    flops_total: float
    reward_failures: int


def write_summary(trainer: Trainer, state: dict, start: float) -> dict:
    """Rank 0 at the end: both adapter layouts, the plots, summary.json."""
    cfg = trainer.cfg
    export(trainer)
    from ..plots import plot_run  # matplotlib: imported when a run ends, not when trillora starts

    plots = plot_run(cfg.run_dir)
    out = export_dir(cfg)
    layouts = f"{out}/fused (PEFT), {out}/per_expert (vLLM)" if cfg.finetune == "lora" else str(out)
    trainer.console.print(f"plots: {', '.join(str(p) for p in plots)}\n{out.name}: {layouts}")
    dims = trainer.world.dims
    summary = {
        "eval_before": state["eval_before"],
        "eval_after": state["accuracy"],
        "retention_before": state["retention_before"],
        "retention_after": state["retention_after"],
        "steps": cfg.steps,
        "steps_done": state["steps_done"],
        "seconds": time.perf_counter() - start,
        "flops_total": trainer.flops_total,
        "skipped_updates": trainer.update.skipped_updates,
        "reward_failures": trainer.reward_failures,
        "dataset_rows_skipped": len(getattr(trainer.task, "skipped", [])),
        "little_signal_warnings": trainer.report.little_signal_warnings,
        "finetune": cfg.finetune,
        "adapter": lora.adapter_stats(trainer.full),
        **(
            {
                "parallel": dataclasses.asdict(dims),
                "parallel_auto": cfg.parallel.auto,
                "dp_grad_bytes_per_step": trainer.world.par.grad_sync.bytes_per_step,
            }
            if trainer.world.size > 1
            else {}
        ),
    }
    retention = (
        f" (retention {summary['retention_before']:.1%} → {summary['retention_after']:.1%})"
        if summary["retention_before"] is not None
        else ""
    )
    trainer.console.print(
        f"held-out accuracy {summary['eval_before']:.1%} → {summary['eval_after']:.1%}{retention} after "
        f"{summary['steps_done']} steps, {summary['seconds']:.0f} s; summary: {cfg.run_dir / 'summary.json'}"
    )
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def export_dir(cfg: TrainConfig) -> Path:
    return cfg.run_dir / ("model" if cfg.finetune == "full" else "adapter")


def export(trainer: Trainer) -> None:
    """Both adapter layouts under runs/<name>/adapter/ (PEFT's fused tensors, vLLM's per-expert names);
    full-parameter training writes the whole model and tokenizer to runs/<name>/model/ instead."""
    if trainer.cfg.finetune == "full":
        save_model(trainer.full, export_dir(trainer.cfg))
        trainer.tokenizer.save_pretrained(export_dir(trainer.cfg))
        return
    named, folder = trainer.cfg.model.path, resolve_model_path(trainer.cfg.model.path)
    base = named if HUB_ID.fullmatch(named) and not Path(named).exists() else str(folder)  # a Hub id stays one
    fingerprint = base_fingerprint(folder)  # once for both layouts
    for layout in EXPERT_LAYOUTS:
        lora.save_adapter(
            trainer.full, export_dir(trainer.cfg) / layout, layout, base_model=base, base_fingerprint=fingerprint
        )
