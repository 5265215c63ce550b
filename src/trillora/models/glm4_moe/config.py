"""GLM-4.5's config.json: GQA with q/k/v bias, an optional q/k norm (`use_qk_norm`) and partial
rotary (`partial_rotary_factor`), and DeepSeek-V3's MoE."""

from __future__ import annotations

from typing import Any

from ..args import ModelArgs
from ..config_keys import get
from ..deepseek_v3.config import sigmoid_moe


def parse(cfg: dict[str, Any], common: dict[str, Any], where: str) -> ModelArgs:
    head_dim = int(get(cfg, "head_dim", default=common["hidden_size"] // common["num_heads"]))
    factor = float(
        get(
            cfg.get("rope_parameters") or {},
            "partial_rotary_factor",
            default=get(cfg, "partial_rotary_factor", default=1.0),
        )
    )
    return ModelArgs(
        **common,
        head_dim=head_dim,
        qk_norm=bool(get(cfg, "use_qk_norm", default=False)),
        rotary_dim=int(head_dim * factor),
        **sigmoid_moe(cfg, common, where),
        num_mtp_layers=int(get(cfg, "num_nextn_predict_layers", default=0)),
    )
