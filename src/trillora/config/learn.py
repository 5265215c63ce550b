"""The `[learn]` section: how a served policy learns from its recorded traffic
(`trillora serve MODEL --record STORE --learn CONFIG`, `trainer.learner`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .checks import check_fields

GATES = ("", "env", "traces")
FROM_KEYS = ("operator", "all")


@dataclass(kw_only=True, frozen=True)
class LearnSection:
    """`trillora serve MODEL --record STORE --learn CONFIG`: the served policy learns from its traffic."""

    every: int = 8
    """Train a new revision once this many rewarded traces are new to the learner."""
    minutes: float = 0.0
    """Or once this many minutes have passed since the last round with at least one (0: by count only)."""
    max_staleness: int = 4
    """Traces served by a revision more than this many revisions before the learner's are dropped (counted)."""
    max_tokens: int = 16384
    """Tokens one round trains on (it runs between served requests: its size bounds how long they wait);
    a trace longer than this is left out (counted)."""
    keep: int = 3
    """Published revisions kept servable (requests in flight finish on theirs; rollback goes back to one)."""
    reward: str = ""
    """`module:function(calls) -> float` scoring a trace that has no feedback ("" = feedback only)."""
    publish_as: str = ""
    """The served name whose requests get each new revision ("" = the model's own name)."""
    from_keys: str = "operator"
    """Whose rewarded traffic trains when the server has several `--api-key`: "operator" (the first key's;
    the others' traces are left out and counted: any key's feedback otherwise moves what every key is
    served) or "all" (each key's traces measured against its own). With one key, its traffic."""
    baseline_decay: float = 0.9
    """A trace whose task does not recur in its batch is measured against a running mean reward of its
    tag (`metadata.task`): mean ← decay · mean + (1 - decay) · reward."""
    gate: str = ""
    """Check each new revision before it is served ("" = no check): `env`, on the held-out episodes
    of `[task]` (`task.name = "env"`, `task.eval_problems` of them); `traces`, on recorded traces
    held out of training (`holdout`), each replayed from its first prompt and scored by `reward`.
    One scoring below the best served so far by more than `gate_tolerance` is not published, and
    the learner goes back to the last one."""
    gate_tolerance: float = 0.05
    """How far below the best gate score so far a revision may score and still be published."""
    holdout: float = 0.1
    """With `gate = "traces"`: the share of traces (by a hash of their key) never trained on and
    replayed by the gate instead."""
    gate_traces: int = 32
    """With `gate = "traces"`: how many held-out traces the gate replays (the oldest: a fixed set
    once there are this many)."""

    def validate(self) -> None:
        positive = "every gate_traces keep max_tokens"
        check_fields(self, "learn.", positive, zero_ok="minutes gate_tolerance max_staleness")
        if self.from_keys not in FROM_KEYS:
            raise ConfigError(f"learn.from_keys={self.from_keys!r}; allowed: {', '.join(map(repr, FROM_KEYS))}")
        if self.gate not in GATES:
            raise ConfigError(f"learn.gate={self.gate!r}; allowed: {', '.join(repr(g) for g in GATES)}")
        if self.gate == "traces" and not self.reward:
            raise ConfigError(
                "learn.gate='traces' scores each replayed trace with learn.reward: name a 'module:function'"
            )
        if not 0.0 < self.holdout < 1.0:
            raise ConfigError(f"learn.holdout={self.holdout}; allowed: 0 < holdout < 1")
        if not 0.0 <= self.baseline_decay < 1.0:
            raise ConfigError(f"learn.baseline_decay={self.baseline_decay}; allowed: 0 <= decay < 1")
        if self.reward and ":" not in self.reward:
            raise ConfigError(f"learn.reward={self.reward!r}: a 'module:function' name, or \"\" for feedback only")
