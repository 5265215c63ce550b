"""DeepSeek-V3 and Kimi K2: multi-head latent attention, sigmoid group-limited routing,
shared experts, and dense MLPs in the first `first_k_dense_replace` layers.

Multi-token-prediction layers (index >= num_hidden_layers) are not part of this
model; the checkpoint loader skips them.
"""

from __future__ import annotations

from ..args import ModelArgs
from ..attention import MLAttention
from ..layers import SwiGLU
from ..moe import MoE
from ..transformer import CausalLM, DecoderLayer


def build(args: ModelArgs) -> CausalLM:
    def layer(i: int) -> DecoderLayer:
        mlp = MoE(args) if args.is_moe_layer(i) else SwiGLU(args.hidden_size, args.intermediate_size)
        return DecoderLayer(args, MLAttention(args), mlp)

    return CausalLM(args, layer, rope_dim=args.qk_rope_head_dim)
