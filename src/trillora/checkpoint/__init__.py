"""Hugging Face checkpoint I/O (safetensors only: no pickle anywhere)."""

from .fp8 import dequantize_blockwise, quantize_blockwise
from .hf import CheckpointError, hf_state_dict, load_model, load_tokenizer, load_weights, save_model

__all__ = [
    "CheckpointError",
    "dequantize_blockwise",
    "hf_state_dict",
    "load_model",
    "load_tokenizer",
    "load_weights",
    "quantize_blockwise",
    "save_model",
]
