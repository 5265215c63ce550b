"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B) and dense Qwen3: GQA with q/k norms, softmax top-k
experts on the layers `decoder_sparse_step` and `mlp_only_layers` name (the rest dense SwiGLU)."""

from ..family import Family
from ..transformer import build
from .config import parse

FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe", "qwen3"),
    architectures={"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen3ForCausalLM": "qwen3"},
    parse=parse,
    build=build,
)
