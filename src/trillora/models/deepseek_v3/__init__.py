"""DeepSeek-V3 and Kimi K2: multi-head latent attention, sigmoid group-limited routing, shared experts,
dense MLPs in the first `first_k_dense_replace` layers. Multi-token-prediction layers (index >=
num_hidden_layers) are not part of the model (the loader skips them)."""

from ..family import Family
from ..transformer import build
from .config import parse

FAMILY = Family(
    name="deepseek_v3",
    model_types=("deepseek_v3", "kimi_k2"),
    architectures={"DeepseekV3ForCausalLM": "deepseek_v3"},
    parse=parse,
    build=build,
)
