"""Experiment trackers beside `metrics.jsonl`: TensorBoard and Weights & Biases (`logging.backends`).

The JSONL file stays the record (checkpoints carry it, plots and tests read it); trackers get the
same numbers, one scalar per metric and step, for people who watch runs in those tools. W&B runs
offline unless `WANDB_API_KEY` is set, so nothing leaves the machine by default. On resume the
TensorBoard writer purges events past the resumed step, so the curves do not fork, and W&B
continues the same run: its id is kept in `wandb/run_id` and passed back with `resume="allow"`
(offline, each start writes its own folder under that id; `wandb sync` joins them into one run).
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
from pathlib import Path

from ..errors import ConfigError


def _need(module: str, backend: str):
    try:
        return __import__(module)
    except ImportError:
        raise ConfigError(
            f"logging.backends has {backend!r} but {module} is not installed: pip install 'trillora[tracking]'"
        ) from None


class Trackers:
    def __init__(self, cfg, first_step: int):
        self.tb = self.wandb = None
        run_dir = Path(cfg.run_dir)
        if "tensorboard" in cfg.logging.backends:
            _need("tensorboard", "tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=first_step or None)
        if "wandb" in cfg.logging.backends:
            wandb = _need("wandb", "wandb")
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
            id_file = run_dir / "wandb" / "run_id"
            resumed = first_step > 0 and id_file.is_file()
            run_id = (
                id_file.read_text().strip() if resumed else secrets.token_hex(4)
            )  # W&B ids are short [a-z0-9] strings
            id_file.write_text(run_id)
            self.wandb = wandb.init(
                project=cfg.logging.project,
                name=cfg.name,
                dir=str(run_dir),
                mode=mode,
                config=dataclasses.asdict(cfg),
                reinit="finish_previous",
                id=run_id,
                resume="allow" if resumed else None,
            )

    def log(self, row: dict, step: int) -> None:
        """The row's finite numbers at `step` (the trainer's step count, 1-based after an update)."""
        scalars = {
            k: float(v)
            for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
