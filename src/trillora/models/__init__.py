"""Model families as plain modules; no LoRA, parallelism or RL in here."""

from .args import ConfigError, ModelArgs
from .family import Family, ReleaseLayout
from .kv_cache import KVCache
from .moe import MoE, set_grouped_gemm
from .registry import build_model, family_of, from_hf_config, load_hf_config, register, release_of
from .transformer import CausalLM

__all__ = [
    "CausalLM",
    "ConfigError",
    "Family",
    "KVCache",
    "ModelArgs",
    "MoE",
    "ReleaseLayout",
    "build_model",
    "family_of",
    "from_hf_config",
    "load_hf_config",
    "register",
    "release_of",
    "set_grouped_gemm",
]
