"""LoRA on dense and expert layers: targeting by role, grouped expert adapters, merge,
adapter-off reference, and adapters in PEFT / vLLM layouts."""

from .apply import (
    adapter_skeleton,
    adapter_stats,
    apply_lora,
    disable_adapter,
    lora_modules,
    lora_parameters,
    merge,
    select_targets,
    trained_parameters,
    unmerge,
)
from .config import ROLES, LoraConfig, LoraConfigError
from .export import (
    AdapterError,
    adapter_base,
    adapter_config,
    adapter_folder,
    adapter_tensors,
    fill_adapter,
    load_adapter,
    save_adapter,
)

__all__ = [
    "ROLES",
    "AdapterError",
    "LoraConfig",
    "LoraConfigError",
    "adapter_base",
    "adapter_folder",
    "adapter_config",
    "adapter_skeleton",
    "adapter_stats",
    "adapter_tensors",
    "apply_lora",
    "disable_adapter",
    "fill_adapter",
    "load_adapter",
    "lora_modules",
    "lora_parameters",
    "trained_parameters",
    "merge",
    "save_adapter",
    "select_targets",
    "unmerge",
]
