"""gpt-oss tensors as released <-> as our modules hold them (the family's `ReleaseLayout`).

Released (and transformers') experts are [E, in, out] with gate and up interleaved column by
column (gate_0, up_0, gate_1, ...), biases interleaved the same way; the router is
`mlp.router`. Ours are [E, out, in] like every other family, gate rows then up rows, and the
router is `mlp.gate`, so LoRA, expert parallelism and grouped GEMM need nothing special.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..family import ReleaseLayout
from .mxfp4 import dequantize_mxfp4


def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(g0, u0, g1, u1, ...) along `dim` -> (g0, g1, ..., u0, u1, ...)."""
    pairs = t.unflatten(dim, (t.shape[dim] // 2, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)


def interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of `deinterleave`."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def mxfp4_experts(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """`...experts.gate_up_proj` / `down_proj` from MXFP4 blocks [E, out, in/32, 16] (stored [E, out, in]
    unlike the bf16 release) as per-expert tensors `...experts.{e}.gate_proj.weight` etc., one expert at a
    time so a 120b layer is never dequantised whole."""
    prefix, _, proj = name.rpartition(".")
    for e in range(blocks.shape[0]):
        w = dequantize_mxfp4(blocks[e], scales[e])  # [out, in]
        if proj == "gate_up_proj":
            yield f"{prefix}.{e}.gate_proj.weight", w[0::2]
            yield f"{prefix}.{e}.up_proj.weight", w[1::2]
        else:
            yield f"{prefix}.{e}.down_proj.weight", w


class GptOssRelease(ReleaseLayout):
    """gpt-oss checkpoints keep their experts stacked (one expert layout), vLLM keeps them as 3-D
    tensors (`is_3d_moe_weight`) and so reads PEFT's fused adapter form, and the release ships the
    experts in MXFP4."""

    expert_layouts = ("fused",)
    vllm_expert_layout = "fused"
    quantized_experts = "mxfp4"

    def from_release(
        self, name: str, tensor: torch.Tensor, pending: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if name.endswith(("_blocks", "_scales")):  # MXFP4 experts: blocks and scales may sit in different shards
            base, _, kind = name.rpartition("_")
            partner = f"{base}_{'scales' if kind == 'blocks' else 'blocks'}"
            if partner not in pending:
                pending[name] = tensor
                return
            blocks, scales = (tensor, pending.pop(partner)) if kind == "blocks" else (pending.pop(partner), tensor)
            yield from mxfp4_experts(base, blocks, scales)
            return
        name = name.replace(".mlp.router.", ".mlp.gate.")
        if name.endswith(".mlp.experts.gate_up_proj"):  # [E, C, 2I] interleaved -> [E, 2I, C]
            tensor = deinterleave(tensor.transpose(1, 2), dim=1)
        elif name.endswith(".mlp.experts.gate_up_proj_bias"):  # [E, 2I]
            tensor = deinterleave(tensor, dim=1)
        elif name.endswith(".mlp.experts.down_proj"):  # [E, I, C] -> [E, C, I]
            tensor = tensor.transpose(1, 2)
        yield name, tensor

    def to_release(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        if name.endswith(".mlp.experts.gate_up_proj"):
            tensor = interleave(tensor, dim=1).transpose(1, 2)
        elif name.endswith(".mlp.experts.gate_up_proj_bias"):
            tensor = interleave(tensor, dim=1)
        elif name.endswith(".mlp.experts.down_proj"):
            tensor = tensor.transpose(1, 2)
        return name.replace(".mlp.gate.", ".mlp.router."), tensor.contiguous()

    def module_name(self, ours: str) -> str:
        """The router is `mlp.router` in transformers' gpt-oss, `mlp.gate` in ours."""
        return ours.replace(".mlp.gate", ".mlp.router") if ours.endswith(".mlp.gate") else ours

    def gate_up_to_release(self, rows: torch.Tensor, dim: int) -> torch.Tensor:
        return interleave(rows, dim)

    def gate_up_from_release(self, rows: torch.Tensor, dim: int) -> torch.Tensor:
        return deinterleave(rows, dim)
