"""`trillora train task.name="traces" task.options.store=STORE`: learning from recorded traffic, offline.

The online learner's rounds (`trainer.learner.Learner`: the trainer's own update over rewarded
traces, the recorded logprobs as the behaviour policy) on a base loaded here instead of a server's:
each step is one round of at most `learn.max_tokens` tokens, the oldest untrained traces first,
until `steps` rounds or no rewarded trace is left. The store remembers what was trained, so a
second run goes on with the traces that came since. Writes runs/<name>/: config.toml,
metrics.jsonl (a row per round: the update's metrics, importance ratios included, and what was
left out), and adapter/ in PEFT layout (loadable by `trillora serve`, vLLM and PEFT).
"""

from __future__ import annotations

import json

import torch

from .. import lora
from ..checkpoint import load_model, load_tokenizer
from ..config import TrainConfig, to_toml
from ..errors import ConfigError
from ..policy.adapters import ResidentBase
from ..policy.world import pick_device
from ..traces import TraceStore
from .learner import Learner


def train_on_traces(cfg: TrainConfig) -> dict:
    store_at = cfg.task.options.get("store")
    if not isinstance(store_at, str) or not store_at:
        raise ConfigError(
            'task.name="traces" needs task.options.store: the SQLite file or postgresql:// URL '
            "that `trillora serve --record` wrote"
        )
    device = pick_device(cfg.device)
    tokenizer = load_tokenizer(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    base = ResidentBase(load_model(cfg.model.path, device=device), alpha=cfg.lora.alpha)
    run = cfg.run_dir
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.toml").write_text(to_toml(cfg))
    store = TraceStore(store_at)
    learner = Learner(base, store, cfg, lambda k, tensors, config: None, run / "revisions", device, tokenizer)
    rows = []
    with open(run / "metrics.jsonl", "a") as log:
        for step in range(cfg.steps):
            row = learner.step()
            if row is None:
                break
            rows.append({"step": step + 1, **row})
            log.write(json.dumps(rows[-1]) + "\n")
            log.flush()
    export_adapter(learner, cfg, run / "adapter")
    summary = {
        "rounds": len(rows),
        "revision": learner.revision,
        "traces": sum(r.get("traces", 0) for r in rows),
        "adapter": str(run / "adapter"),
        "store": store.shown,
    }
    (run / "summary.json").write_text(json.dumps(summary, indent=2))
    store.close()
    return summary


def export_adapter(learner: Learner, cfg: TrainConfig, folder) -> None:
    """The learner's adapter in PEFT layout: its slot tensors written into the base's adapter skeleton
    (`lora.adapter_skeleton`: the adapter applied the usual way, no copy of the base), saved as
    `trillora train` saves."""
    a = learner.adapter
    model = lora.adapter_skeleton(learner.base.model, torch.device("cpu"), a.config)  # its config: the base's alpha
    mine = dict(lora.lora_parameters(model))
    if set(mine) != set(a.params):
        raise ConfigError(
            f"the learner's adapter does not map onto {cfg.model.path}'s modules: "
            f"{sorted(set(mine) ^ set(a.params))[:3]}"
        )
    with torch.no_grad():
        for name, p in mine.items():
            p.copy_(a.params[name].detach().to(p.device, p.dtype))
    lora.save_adapter(model, folder)
