"""Model families as plain modules; no LoRA, parallelism or RL in here."""

from .args import ConfigError, ModelArgs, from_hf_config, load_hf_config
from .kv_cache import KVCache
from .moe import MoE, set_grouped_gemm
from .registry import build_model
from .transformer import CausalLM

__all__ = [
    "CausalLM",
    "ConfigError",
    "KVCache",
    "ModelArgs",
    "build_model",
    "from_hf_config",
    "load_hf_config",
    "MoE",
    "set_grouped_gemm",
]
