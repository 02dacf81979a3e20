"""FP8 e4m3 block-quantized weights (DeepSeek/MiMo style ``weight_scale_inv``).

A ``[R, C]`` FP8 weight comes with ``weight_scale_inv`` of shape ``[ceil(R/bR), ceil(C/bC)]``; the real value
of element ``(i, j)`` is ``w[i, j] * scale_inv[i // bR, j // bC]`` (the name says "inverse" because the
quantizer divided by it).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn


def expand_block_scales(scale_inv: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """Broadcast a block-scale grid to a full ``[rows, cols]`` float32 tensor."""
    br, bc = block
    need = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != need:
        raise ValueError(f"block scales have shape {tuple(scale_inv.shape)}; expected {need} for a "
                         f"[{rows}, {cols}] weight with {br}x{bc} blocks")
    s = scale_inv.float().repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)
    return s[:rows, :cols]


def dequant_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128), dtype=torch.float32
) -> torch.Tensor:
    """Dequantize a 2-D FP8 weight with per-block scales into ``dtype``."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D FP8 weight, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    return (weight.float() * expand_block_scales(scale_inv, rows, cols, block)).to(dtype)


def quant_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`dequant_fp8_block` (per-block absmax scaling); used to build test checkpoints."""
    rows, cols = weight.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale_inv = amax / torch.finfo(FP8_DTYPE).max
    q = (blocks / scale_inv[:, None, :, None]).view(nr * br, nc * bc)[:rows, :cols].to(FP8_DTYPE)
    return q, scale_inv
