"""Checkpoint tensor layouts: the V2.5/Pro fused ``qkv_proj`` and its FP8 block scales.

The fused projection is stored as ``G`` contiguous groups (one per KV-head group), each ``[Q_c | K_c | V_c]``:

    [Q_1 K_1 V_1 | Q_2 K_2 V_2 | ... | Q_G K_G V_G]

with ``Q_c`` = ``num_heads/G`` query heads, ``K_c``/``V_c`` = ``num_kv_heads/G`` KV heads. It is *not*
``[Q; K; V]``, so a plain split by sizes would mix heads.

Two FP8 scale layouts exist: per-group padded (each group quantized on its own, ``G * ceil(rows_g/128)``
scale rows) and globally packed (``ceil(rows/128)`` rows, blocks may straddle groups). The row count of the
scale tensor tells them apart; when both counts agree the layouts coincide or we pick per-group.
"""

from __future__ import annotations

import torch

from kernels.fp8 import dequant_fp8_block


def split_fused_qkv(
    fused: torch.Tensor, num_heads: int, num_kv_heads: int, qk_dim: int, v_dim: int, num_kv_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a dequantized fused ``[rows, hidden]`` qkv weight into ``(q, k, v)`` in head order."""
    if num_heads % num_kv_groups or num_kv_heads % num_kv_groups:
        raise ValueError(f"fused qkv: {num_kv_groups} groups do not divide heads {num_heads}/{num_kv_heads}")
    qh, kvh = num_heads // num_kv_groups, num_kv_heads // num_kv_groups
    sizes = [qh * qk_dim, kvh * qk_dim, kvh * v_dim]
    expected = num_kv_groups * sum(sizes)
    if fused.shape[0] != expected:
        raise ValueError(f"fused qkv has {fused.shape[0]} rows; expected {expected} "
                         f"({num_kv_groups} groups x [Q {sizes[0]} | K {sizes[1]} | V {sizes[2]}])")
    groups = fused.view(num_kv_groups, sum(sizes), -1)
    q, k, v = groups.split(sizes, dim=1)
    return tuple(t.reshape(-1, fused.shape[1]) for t in (q, k, v))  # type: ignore[return-value]


def dequant_fused_qkv_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, num_kv_groups: int, block: tuple[int, int] = (128, 128),
    dtype=torch.float32,
) -> torch.Tensor:
    """Dequantize a fused FP8 qkv weight under either scale layout (see module docstring)."""
    rows, cols = weight.shape
    rows_g = rows // num_kv_groups
    per_group_rows = -(-rows_g // block[0])
    if scale_inv.shape[0] == num_kv_groups * per_group_rows and rows % num_kv_groups == 0:
        parts = [
            dequant_fp8_block(weight[c * rows_g:(c + 1) * rows_g],
                              scale_inv[c * per_group_rows:(c + 1) * per_group_rows], block, dtype)
            for c in range(num_kv_groups)
        ]
        return torch.cat(parts)
    if scale_inv.shape[0] == -(-rows // block[0]):
        return dequant_fp8_block(weight, scale_inv, block, dtype)
    raise ValueError(f"fused qkv scale has {scale_inv.shape[0]} rows; expected {num_kv_groups * per_group_rows} "
                     f"(per-group padded) or {-(-rows // block[0])} (packed) for {rows} rows")
