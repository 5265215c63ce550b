"""gpt-oss (20b, 120b): biased GQA with learned sinks and alternating sliding windows, every layer
a MoE with a biased top-k-softmax router and clamped SwiGLU experts, released in MXFP4."""

from ..family import Family
from .config import parse
from .model import build
from .state_dict import GptOssRelease

FAMILY = Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    architectures={"GptOssForCausalLM": "gpt_oss"},
    parse=parse,
    build=build,
    release=GptOssRelease(),
)
