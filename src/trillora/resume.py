"""The trainer's side of checkpoints: when to save, what goes in, how a run picks up again.

Every rank writes its own tensors (adapter shards, AdamW state, torch RNG); rank 0 adds the
run's JSON state, metrics, config and a PEFT-layout adapter and commits the folder
(`checkpoint.train_state`). A SIGTERM or Ctrl-C asks the loop to stop after the step in
progress, save, and exit: the step is never cut in half by our own shutdown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

from . import lora
from .checkpoint import train_state
from .config import ConfigError, to_toml

console = Console(stderr=True, soft_wrap=True)  # paths stay on one line


class TrainingDiverged(RuntimeError):
    """Too many updates in a row had a non-finite loss or gradient; the last good state is saved."""


@dataclasses.dataclass
class Resumed:
    """What the loop needs from a checkpoint to go on."""

    step: int
    state: dict


class RunCheckpoints:
    def __init__(self, trainer):
        self.t = trainer
        self.root: Path = trainer.cfg.run_dir / "checkpoints"
        self.rank = trainer.dist.rank if trainer.dist is not None else 0
        self.saved_step = -1

    def _barrier(self) -> None:
        if self.t.dist is not None:
            dist.barrier()

    def _layout(self) -> dict:
        """As state.json holds it (JSON lists, not tuples), so a reloaded one compares equal."""
        d = self.t.dist
        return json.loads(json.dumps({"world": d.world, "dims": dataclasses.asdict(d.par.dims)} if d else {"world": 1}))

    # --- starting ------------------------------------------------------------------------
    def start(self) -> Resumed | None:
        """Fresh run: an earlier run's checkpoints step aside. `resume`: load the newest complete one."""
        t = self.t
        if not t.cfg.resume:
            if t.main and self.root.exists():
                previous = self.root.with_name("checkpoints.previous")
                shutil.rmtree(previous, ignore_errors=True)
                self.root.rename(previous)
                console.print(f"a new run: the earlier checkpoints are now in {previous} (resume=true continues a run)")
            self._barrier()
            return None
        found = train_state.find_latest(self.root)
        if t.main:
            for what in found.skipped:
                console.print(f"[yellow]checkpoint skipped[/]: {what}")
        if found.path is None:
            if t.main:
                console.print(f"resume=true but {self.root} holds no complete checkpoint: starting from step 0")
            self._barrier()
            return None
        state, tensors = train_state.load(found.path, self.rank)
        if state["layout"] != self._layout():
            raise ConfigError(f"{found.path} was written by a run with layout {state['layout']}; this run has "
                              f"{self._layout()}: resume with the same torchrun size and parallel settings")
        params = dict(lora.lora_parameters(t.model))
        train_state.restore_rank_tensors(tensors, params, t.opt, found.path / f"rank-{self.rank}.safetensors")
        train_state.restore_python_rng(state["rng"])
        t.skipped_updates, t.nonfinite_in_a_row = state["skipped_updates"], state["nonfinite_in_a_row"]
        t.reward.failures = state["reward_failures"]
        self._barrier()
        if t.main:
            train_state.clear_partials(self.root)
            console.print(f"resuming from {found.path} (step {state['step']})")
        t.sync_engine()  # the engine samples with the restored adapter (a collective under torchrun)
        self.saved_step = state["step"]
        return Resumed(step=state["step"], state=state)

    # --- saving --------------------------------------------------------------------------
    def due(self, step: int, stopping: bool) -> bool:
        every = self.t.cfg.checkpoint.every
        return stopping or step == self.t.cfg.steps or (every > 0 and step % every == 0)

    def save(self, step: int, run_state: dict, metrics_file: Path | None) -> Path | None:
        """All ranks: write this rank's file; rank 0 then commits the checkpoint of `step` done steps."""
        t = self.t
        params = dict(lora.lora_parameters(t.model))
        train_state.write_rank_file(self.root, step, self.rank, train_state.rank_tensors(params, t.opt))
        self._barrier()
        path = None
        if t.main:
            part = train_state.partial_dir(self.root, step)
            lora.save_adapter(t.full, part / "adapter", expert_layout="per_expert")
            state = {"step": step, "rng": train_state.python_rng_state(), "skipped_updates": t.skipped_updates,
                     "nonfinite_in_a_row": t.nonfinite_in_a_row, "reward_failures": t.reward.failures,
                     "layout": self._layout(), **run_state}
            files = {"config.toml": to_toml(t.cfg), "metrics.jsonl": metrics_file.read_text() if metrics_file else ""}
            path = train_state.commit(self.root, step, state, files, t.cfg.checkpoint.keep)
        self._barrier()
        self.saved_step = step
        return path

    def metrics_of(self, resumed: Resumed) -> str:
        return (train_state.step_dir(self.root, resumed.step) / "metrics.jsonl").read_text()


class StopSignal:
    """SIGTERM / SIGINT set a flag the loop reads between steps; under torchrun the ranks agree
    (any rank stopping stops all), so they all save the same checkpoint."""

    def __init__(self, distributed: bool, device: torch.device):
        self.requested = False
        self.distributed, self.device = distributed, device

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

        def handler(signum, frame):
            if self.requested:  # a second signal: stop now
                signal.signal(signum, previous[signum])
                signal.raise_signal(signum)
            self.requested = True
            console.print("[yellow]stopping after this step; a checkpoint will be saved (signal again to stop now)[/]")

        for s in previous:
            signal.signal(s, handler)
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def now(self) -> bool:
        if not self.distributed:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
