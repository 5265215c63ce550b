"""GLM-4.5 and GLM-4.5-Air: GQA with bias on q, k and v (not o), an optional q/k norm and rope on
half of each head; DeepSeek-V3's MoE after `first_k_dense_replace` dense layers. The
multi-token-prediction layer stored after the decoder is not part of the model (the loader skips it)."""

from ..family import Family
from ..transformer import build
from .config import parse

FAMILY = Family(
    name="glm4_moe",
    model_types=("glm4_moe",),
    architectures={"Glm4MoeForCausalLM": "glm4_moe"},
    parse=parse,
    build=build,
)
