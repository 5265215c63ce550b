"""gpt-oss (20b, 120b): grouped-query attention with bias on q, k, v and o, a learned sink logit
per head, a 128-token sliding window on every other layer, YaRN; every layer a MoE whose router
has a bias and softmaxes only the top-k logits, with biased experts and a clamped SwiGLU.

The released layout differs from ours in three ways the checkpoint loader undoes
(`state_dict.py`): expert weights are stored transposed ([E, in, out]), gate and
up are interleaved column by column, and the experts ship as MXFP4 blocks with scales.
"""

from __future__ import annotations

from ..args import ModelArgs
from ..attention import GQAttention
from ..moe import MoE
from ..transformer import CausalLM, DecoderLayer


def build(args: ModelArgs) -> CausalLM:
    return CausalLM(args, lambda i: DecoderLayer(args, GQAttention(args, i), MoE(args)), rope_dim=args.head_dim)
