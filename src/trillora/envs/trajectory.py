"""A trajectory's turns as training sequences.

Each turn's observation is the whole context the policy saw. When it extends the previous
observation + action token for token (the prefix property: the usual chat history), the turn
continues the same sequence: the new observation tokens (tool output, the user's reply) go in with
loss mask 0, the action with mask 1 and the engine's own logprobs. When it does not (a template
that rewrites history, a summarised memory), a new sequence starts. The engine's token ids are
used as they are: nothing is decoded and tokenized again, so the trainer scores exactly the tokens
that were sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

from .env import Trajectory


@dataclass
class Sample:
    """One training sequence: its tokens, which of them the policy produced, their sampling logprobs."""

    tokens: list[int]
    mask: list[int]  # 1 where the policy produced the token (it is trained on), 0 for observations
    logprobs: list[float]  # the engine's logprob where mask is 1, 0.0 elsewhere
    prompt_length: int  # tokens before the first action token

    @staticmethod
    def single_turn(prompt: list[int], completion: list[int], logprobs: list[float]) -> Sample:
        return Sample(
            list(prompt) + list(completion),
            [0] * len(prompt) + [1] * len(completion),
            [0.0] * len(prompt) + [float(x) for x in logprobs],
            len(prompt),
        )


def merge_trajectory(trajectory: Trajectory) -> list[Sample]:
    """The fewest sequences that hold every turn: a new one only where the prefix property breaks."""
    samples: list[Sample] = []
    current: Sample | None = None
    for turn, t in enumerate(trajectory.transitions):
        if len(t.logprobs) != len(t.action):
            raise ValueError(f"turn {turn}: {len(t.action)} action tokens but {len(t.logprobs)} logprobs")
        ob = list(t.observation)
        if current is not None and len(ob) >= len(current.tokens) and ob[: len(current.tokens)] == current.tokens:
            added = ob[len(current.tokens) :]
            current.tokens += added
            current.mask += [0] * len(added)
            current.logprobs += [0.0] * len(added)
        else:
            if current is not None:
                samples.append(current)
            current = Sample(ob, [0] * len(ob), [0.0] * len(ob), len(ob))
        current.tokens += list(t.action)
        current.mask += [1] * len(t.action)
        current.logprobs += [float(x) for x in t.logprobs]
    if current is not None:
        samples.append(current)
    return samples
