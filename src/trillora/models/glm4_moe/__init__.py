"""GLM-4.5 and GLM-4.5-Air: GQA with q/k/v bias and partial rotary, DeepSeek-V3's MoE."""

from ..family import Family
from .config import parse
from .model import build

FAMILY = Family(
    name="glm4_moe",
    model_types=("glm4_moe",),
    architectures={"Glm4MoeForCausalLM": "glm4_moe"},
    parse=parse,
    build=build,
)
