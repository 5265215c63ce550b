"""The trainer: one step loop for every rank, built from parts named after the steps of RL.

loop.py           Trainer: builds the parts, runs the steps, logs, evaluates, finishes
world.py          World: the ranks (one process is a world of size 1), sharing, reductions
sampler.py        rollouts + rewards (+ dynamic sampling) -> RolloutBatch
batch.py          TokenBatch: the rows as tensors, sliced per rank and pass
logprobs.py       the policy's logprobs over rows (whole, or each group's prompt once)
update.py         logprob passes, minibatches, micro-batches, AdamW steps -> metrics
router_replay.py  routing compared with / replayed from the rollout's, from outside the model
engine.py         the rollout engine of the `rollout` section
evaluate.py       held-out scores through the engine
checkpoints.py    saving and resuming a run; signals.py: SIGTERM / Ctrl-C stop cleanly
learner.py        rounds of the update over rewarded recorded traffic (`serve --learn`)
offline.py        the same rounds offline (`task.name = "traces"`)
"""

from .loop import Trainer, train

__all__ = ["Trainer", "train"]
