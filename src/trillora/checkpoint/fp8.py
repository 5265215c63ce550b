"""Block-wise FP8 (e4m3) weights as DeepSeek-V3 and Kimi K2 release them.

`X.weight` is float8_e4m3fn [O, I] and `X.weight_scale_inv` fp32 [ceil(O/b), ceil(I/b)];
the real weight is each fp8 value times the scale of its b×b block (b = 128).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def dequantize_blockwise(w_OI: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    o, i = w_OI.shape
    expected = (-(-o // block), -(-i // block))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} for a {o}x{i} weight"
        )
    scale = scale_inv.float().repeat_interleave(block, 0)[:o].repeat_interleave(block, 1)[:, :i]
    return w_OI.float() * scale


def quantize_blockwise(w_OI: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (fp8 weight, per-block scale_inv): the inverse of `dequantize_blockwise` up to fp8 rounding."""
    o, i = w_OI.shape
    po, pi = -(-o // block) * block, -(-i // block) * block
    padded = torch.zeros(po, pi, dtype=torch.float32)
    padded[:o, :i] = w_OI.float()
    blocks = padded.view(po // block, block, pi // block, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [O/b, I/b]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(po, pi)[:o, :i].contiguous(), scale
