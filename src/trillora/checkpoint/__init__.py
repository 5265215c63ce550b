"""Hugging Face checkpoint I/O (safetensors only: no pickle anywhere), training state, atomic writes."""

from .fp8 import dequantize_blockwise, quantize_blockwise
from .hf import (
    SHIPPED_CHECKPOINTS,
    CheckpointError,
    check_tokenizer_fits,
    fill_model,
    hf_state_dict,
    load_model,
    load_tokenizer,
    load_weights,
    meta_model,
    resolve_model_path,
    save_model,
)

__all__ = [
    "SHIPPED_CHECKPOINTS",
    "CheckpointError",
    "check_tokenizer_fits",
    "fill_model",
    "dequantize_blockwise",
    "hf_state_dict",
    "load_model",
    "load_tokenizer",
    "load_weights",
    "meta_model",
    "quantize_blockwise",
    "resolve_model_path",
    "save_model",
]
