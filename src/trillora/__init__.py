"""trillora: reinforcement learning on Mixture-of-Experts language models through LoRA."""

from .checkpoint import load_model, load_tokenizer, save_model
from .models import CausalLM, ModelArgs

__version__ = "0.1.0"

__all__ = ["CausalLM", "ModelArgs", "__version__", "load_model", "load_tokenizer", "save_model"]
