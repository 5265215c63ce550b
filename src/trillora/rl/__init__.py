"""RL math as pure functions over tensors: no state, no I/O."""

from .advantages import ADVANTAGE_MODES, group_advantages
from .aggregation import AGGREGATIONS, aggregate
from .dynamic_sampling import fill_batch, informative_groups, little_signal
from .kl import KL_ESTIMATORS, entropy_from_logits, kl_estimate
from .logprobs import logprobs_from_logits, scale_by_temperature
from .loss import policy_loss
from .mismatch import MISMATCH_MODES, masked_mean, mismatch_weights

__all__ = [
    "ADVANTAGE_MODES",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "MISMATCH_MODES",
    "aggregate",
    "entropy_from_logits",
    "fill_batch",
    "group_advantages",
    "informative_groups",
    "little_signal",
    "kl_estimate",
    "logprobs_from_logits",
    "scale_by_temperature",
    "masked_mean",
    "mismatch_weights",
    "policy_loss",
]
