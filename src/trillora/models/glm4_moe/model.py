"""GLM-4.5 / GLM-4.5-Air: grouped-query attention with bias on q, k and v (not o), an optional
q/k norm and rope on half of each head; DeepSeek-V3's MoE (sigmoid scores with a selection bias,
a routed scaling factor, one shared expert) after `first_k_dense_replace` dense layers.

The multi-token-prediction layer stored after the decoder is not part of this model; the
checkpoint loader skips it.
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

    return CausalLM(args, layer, rope_dim=args.rope_dim)
