"""Qwen3-MoE (and dense Qwen3): GQA attention with q/k norms, softmax top-k experts.

Which layers hold experts follows `decoder_sparse_step` and `mlp_only_layers`
(already resolved into `args.moe_layers`); the rest use the dense SwiGLU MLP.
"""

from __future__ import annotations

from ..args import ModelArgs
from ..attention import GQAttention
from ..layers import SwiGLU
from ..moe import MoE
from ..transformer import CausalLM, DecoderLayer


def build(args: ModelArgs) -> CausalLM:
    def layer(i: int) -> DecoderLayer:
        mlp = MoE(args) if args.is_moe_layer(i) else SwiGLU(args.hidden_size, args.intermediate_size)
        return DecoderLayer(args, GQAttention(args), mlp)

    return CausalLM(args, layer, rope_dim=args.head_dim)
