"""MXFP4 weights as gpt-oss releases its experts (OCP Microscaling, FP4 E2M1 elements).

`X_blocks` is uint8 [..., G, 16]: 32 four-bit values per group of a row, two per byte, the
low nibble first. `X_scales` is uint8 [..., G]: one power of two per group, stored as E8M0
(exponent + 127). A value is E2M1(nibble) · 2^(scale - 127); a row of G groups has G·32 values.
"""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 four-bit codes: sign bit, two exponent bits, one mantissa bit."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., G, 16] uint8 codes and [..., G] uint8 exponents -> [..., G·32] float32."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} "
            "(expected blocks [..., G, 16] and scales [..., G])"
        )
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = torch.ldexp(values.flatten(-2), (scales.int() - 127)[..., None])  # [..., G, 32]
    return values.flatten(-2)
