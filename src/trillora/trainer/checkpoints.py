"""The trainer's side of checkpoints: when to save, what goes in, how a run picks up again.

Every rank writes its own tensors (adapter shards, AdamW state, torch RNG); rank 0 adds the
run's JSON state, metrics, config and a PEFT-layout adapter and commits the folder
(`checkpoint.train_state`).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from .. import lora
from ..checkpoint import train_state
from ..config import to_toml
from ..errors import ConfigError


@dataclasses.dataclass
class Resumed:
    """What the loop needs from a checkpoint to go on."""

    step: int
    state: dict | None
    """The run's own state (None: another writer's state, `checkpoint.resume_from`)."""


class RunCheckpoints:
    """`trainer`: the `Trainer` whose model, optimizer, counters and engine a checkpoint holds."""

    def __init__(self, trainer):
        self.t = trainer
        self.root: Path = trainer.cfg.run_dir / "checkpoints"
        self.rank = trainer.world.rank
        self.console = trainer.console

    # --- starting ------------------------------------------------------------------------
    def start(self) -> Resumed | None:
        """Fresh run: an earlier run's checkpoints step aside. `resume`: load the newest complete one."""
        t = self.t
        if not t.cfg.resume:
            if t.world.main and self.root.exists():
                previous = self.root.with_name("checkpoints.previous")
                shutil.rmtree(previous, ignore_errors=True)
                self.root.rename(previous)
                self.console.print(
                    f"a new run: the earlier checkpoints are now in {previous} (resume=true continues a run)"
                )
            t.world.barrier()
            return self._from_state()
        found = train_state.find_latest(self.root)
        if t.world.main:
            for what in found.skipped:
                self.console.print(f"[yellow]checkpoint skipped[/]: {what}")
        if found.path is None:
            if t.world.main:
                self.console.print(f"resume=true but {self.root} holds no complete checkpoint: starting anew")
            t.world.barrier()
            return self._from_state()
        state, tensors = train_state.load(found.path, self.rank)
        if state["layout"] != t.world.layout():
            raise ConfigError(
                f"{found.path} was written by a run with layout {state['layout']}; this run has "
                f"{t.world.layout()}: resume with the same torchrun size and parallel settings"
            )
        t.policy.load(tensors, found.path / f"rank-{self.rank}.safetensors")
        train_state.restore_python_rng(state["rng"])
        t.update.skipped_updates, t.update.nonfinite_in_a_row = state["skipped_updates"], state["nonfinite_in_a_row"]
        if t.reward is not None:
            t.reward.failures = state["reward_failures"]
        t.world.barrier()
        if t.world.main:
            train_state.clear_partials(self.root)
            self.console.print(f"resuming from {found.path} (step {state['step']})")
        t.sync_engine()  # the engine samples with the restored adapter (a collective under torchrun)
        return Resumed(step=state["step"], state=state)

    def _from_state(self) -> Resumed | None:
        """`checkpoint.resume_from`: the adapter and AdamW state of a Tinker client's saved state or of
        another run's checkpoint, at the step its AdamW steps make (None: not set)."""
        t, named = self.t, self.t.cfg.checkpoint.resume_from
        if not named:
            return None
        if t.world.size > 1:
            raise ConfigError("checkpoint.resume_from starts a run in one process (its state is whole, not sharded)")
        path = Path(named)
        if not (path / "state.json").is_file():
            raise ConfigError(f"checkpoint.resume_from={named!r}: no saved state there (no state.json)")
        saved = train_state.read_adapter_state(path)
        if not any(k.startswith("optim.") for k in saved.tensors) or "alpha" not in saved.lora:
            raise ConfigError(
                f"checkpoint.resume_from={named!r} holds no AdamW state or no LoRA alpha (a sampler's "
                "weights, or a state saved before states recorded alpha): resume from a save_state"
            )
        lc, a, top_k = t.cfg.lora, t.cfg.algorithm, t.model.args.top_k
        theirs = lora.LoraConfig(**saved.lora)

        def shape(c):
            return c.rank, c.rank_for_experts(top_k), sorted(c.targets), c.alpha, c.rslora

        if shape(theirs) != shape(lc):
            raise ConfigError(
                f"checkpoint.resume_from={named!r} holds a LoRA of (rank, expert rank, targets, alpha, rslora) "
                f"{shape(theirs)}; this run's [lora] is {shape(lc)}: set it to match"
            )
        per_step = a.epochs * a.minibatches
        if saved.run_step is None and saved.optimizer_steps % per_step:
            raise ConfigError(
                f"checkpoint.resume_from={named!r} took {saved.optimizer_steps} AdamW steps, not a whole number of "
                f"this run's steps of {per_step} (algorithm.epochs × minibatches)"
            )
        t.policy.load(saved.tensors, path, rng=False)  # the writer's RNG is not this run's
        step = saved.run_step if saved.run_step is not None else saved.optimizer_steps // per_step
        self.console.print(f"starting from {path} at step {step}")
        t.sync_engine()
        return Resumed(step=step, state=None)

    # --- saving --------------------------------------------------------------------------
    def due(self, step: int, stopping: bool) -> bool:
        every = self.t.cfg.checkpoint.every
        return stopping or step == self.t.cfg.steps or (every > 0 and step % every == 0)

    def save(self, step: int, run_state: dict, metrics_file: Path | None) -> Path | None:
        """All ranks: write this rank's file; rank 0 then commits the checkpoint of `step` done steps."""
        t = self.t
        train_state.write_rank_file(self.root, step, self.rank, t.policy.state())
        t.world.barrier()
        path = None
        if t.world.main:
            part = train_state.partial_dir(self.root, step)
            if t.cfg.finetune == "lora":  # full training: the rank file holds the weights
                lora.save_adapter(t.full, part / "adapter", expert_layout="per_expert")  # synced after the step
            state = {
                "step": step,
                "rng": train_state.python_rng_state(),
                "skipped_updates": t.update.skipped_updates,
                "nonfinite_in_a_row": t.update.nonfinite_in_a_row,
                "reward_failures": t.reward_failures,
                "flops_total": t.flops_total,
                "layout": t.world.layout(),
                **run_state,
            }
            files = {"config.toml": to_toml(t.cfg), "metrics.jsonl": metrics_file.read_text() if metrics_file else ""}
            path = train_state.commit(self.root, step, state, files, t.cfg.checkpoint.keep)
        t.world.barrier()
        return path

    def metrics_of(self, resumed: Resumed) -> str:
        return (train_state.step_dir(self.root, resumed.step) / "metrics.jsonl").read_text()
