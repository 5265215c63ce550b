"""What the trace store keeps: a served call, a piece of feedback, and the errors it answers with."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..errors import TrilloraError


class TraceError(TrilloraError):
    """A store that cannot be opened, or a request it cannot take (what is wrong is named)."""


MAX_REWARD = 1e6
"""Rewards are bounded: one huge reward would make every advantage of its round overflow."""
MAX_FEEDBACK = 32
"""Feedback rows one trace may hold (they are averaged; more only fills the disk)."""
HELD_OUT = -2
"""The `trained` revision of a trace kept out of training for the learner's gate (`learn.holdout`)."""


class TooMuchFeedback(TraceError):
    """A trace that already holds MAX_FEEDBACK rewards."""


class UnknownTrace(TraceError):
    """A trace or response this key's traffic does not hold (another key's is not told apart)."""


@dataclass
class Call:
    """One choice of one served request."""

    response_id: str
    choice: int
    trace_id: str
    owner: str
    model: str
    revision: str
    kind: str  # "chat" or "completion"
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    params: dict = field(default_factory=dict)
    finish_reason: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    user_id: str = ""
    tag: str = ""
    """What kind of task the call served (`metadata.task`): learning keeps a baseline per tag."""
    created: float = field(default_factory=time.time)

    @property
    def revision_number(self) -> int:
        """k of a learner's revision `name@k`; 0 for the base or a loaded adapter."""
        head, _, k = self.revision.rpartition("@")
        return int(k) if head and k.isdigit() else 0


@dataclass
class Feedback:
    trace_id: str
    owner: str
    reward: float
    response_id: str = ""
    label: str = ""
    comment: str = ""
    created: float = field(default_factory=time.time)


class OverBudget(TraceError):
    """A key whose recorded traffic holds its budget of choices or bytes (`--max-trace-rows`, `--max-trace-mib`)."""
