"""DeepSeek-V3 and Kimi K2: multi-head latent attention, sigmoid group-limited routing, shared experts."""

from ..family import Family
from .config import parse
from .model import build

FAMILY = Family(
    name="deepseek_v3",
    model_types=("deepseek_v3", "kimi_k2"),
    architectures={"DeepseekV3ForCausalLM": "deepseek_v3"},
    parse=parse,
    build=build,
)
