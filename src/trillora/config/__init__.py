"""Typed run configuration: dataclass sections (`sections`), TOML files and `key=value` overrides
(`toml`), one validation."""

from ..errors import ConfigError
from .sections import (
    FFN_TARGETS,
    AlgorithmSection,
    CheckpointSection,
    LearnSection,
    LoggingSection,
    MemorySection,
    ModelSection,
    OptimSection,
    ParallelSection,
    RolloutSection,
    RouterReplayMode,
    TaskSection,
    TrainConfig,
)
from .toml import load_config, parse_override, to_toml

__all__ = [
    "FFN_TARGETS",
    "AlgorithmSection",
    "CheckpointSection",
    "ConfigError",
    "LearnSection",
    "LoggingSection",
    "MemorySection",
    "ModelSection",
    "OptimSection",
    "ParallelSection",
    "RolloutSection",
    "RouterReplayMode",
    "TaskSection",
    "TrainConfig",
    "load_config",
    "parse_override",
    "to_toml",
]
