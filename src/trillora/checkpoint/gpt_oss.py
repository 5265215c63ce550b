"""gpt-oss tensors as released <-> as our modules hold them.

Released (and transformers') experts are [E, in, out] with gate and up interleaved column by
column (gate_0, up_0, gate_1, ...), biases interleaved the same way; the router is
`mlp.router`. Ours are [E, out, in] like every other family, gate rows then up rows, and the
router is `mlp.gate`, so LoRA, expert parallelism and grouped GEMM need nothing special.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

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


def from_release(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    name = name.replace(".mlp.router.", ".mlp.gate.")
    if name.endswith(".mlp.experts.gate_up_proj"):  # [E, C, 2I] interleaved -> [E, 2I, C]
        t = deinterleave(t.transpose(1, 2), dim=1)
    elif name.endswith(".mlp.experts.gate_up_proj_bias"):  # [E, 2I]
        t = deinterleave(t, dim=1)
    elif name.endswith(".mlp.experts.down_proj"):  # [E, I, C] -> [E, C, I]
        t = t.transpose(1, 2)
    return name, t


def to_release(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    if name.endswith(".mlp.experts.gate_up_proj"):
        t = interleave(t, dim=1).transpose(1, 2)
    elif name.endswith(".mlp.experts.gate_up_proj_bias"):
        t = interleave(t, dim=1)
    elif name.endswith(".mlp.experts.down_proj"):
        t = t.transpose(1, 2)
    return name.replace(".mlp.gate.", ".mlp.router."), t.contiguous()


def module_name(name: str) -> str:
    """Our module name -> transformers' (for adapter keys): the router is `mlp.router`."""
    return name.replace(".mlp.gate", ".mlp.router") if name.endswith(".mlp.gate") else name
