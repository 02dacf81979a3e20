"""Preprocessing as torch ops on the encoder's device: uint8 frames -> resized, normalised, patchified rows for
``VisionTower`` (Qwen2-VL processor semantics).

Per item: the uint8 pixels go to the device as they are (4× fewer bytes than float32), are resized there to
``smart_resize``'s size (bicubic with antialiasing: torch's antialiased bicubic is PIL's filter, a = -0.5), rounded
back to the uint8 grid as PIL and torchvision do, then /255 and CLIP-normalised; an image is repeated to
``temporal_patch_size`` frames, a video padded with its last frame to a multiple of it. Rows are in the Qwen2-VL
order: per temporal patch, merge × merge units row-major, each unit's patches row-major, each row
(channel, time, y, x).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from libs.mm.spec import grid_thw, smart_resize
from libs.model.vision_config import VisionConfig


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resize_uint8(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``[T, 3, H, W]`` uint8 -> ``[T, 3, height, width]`` on the uint8 grid (rounded, clamped): uint8 on CPU,
    where torch resizes uint8 directly (a fixed-point separable kernel, fastest channels-last), float on CUDA,
    which has no uint8 antialiased bicubic (float then rounded: the same up to a level or two)."""
    if (height, width) == tuple(frames.shape[-2:]):
        return frames
    if frames.device.type == "cpu":
        x = frames.contiguous(memory_format=torch.channels_last)
        return F.interpolate(x, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    x = F.interpolate(frames.float(), size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return x.round_().clamp_(0, 255)


def patchify(x: torch.Tensor, vc: VisionConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``[T, 3, H, W]`` (T a multiple of the temporal patch) -> rows ``[t*h*w, patch_dim]`` (same dtype) and grid."""
    tp, m, p = vc.temporal_patch_size, vc.spatial_merge_size, vc.patch_size
    t, gh, gw = grid_thw(x.shape[0], x.shape[2], x.shape[3], vc)
    x = x.reshape(t, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * gh * gw, vc.patch_dim), (t, gh, gw)


def row_affine(vc: VisionConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) per value of a patch row (channel-major): ``(v / 255 - mean) / std == v * scale + shift``."""
    per = vc.temporal_patch_size * vc.patch_size ** 2
    std = torch.tensor(vc.image_std, dtype=torch.float64)
    mean = torch.tensor(vc.image_mean, dtype=torch.float64)
    scale, shift = 1.0 / (255.0 * std), -mean / std
    return (scale.repeat_interleave(per).float().to(device), shift.repeat_interleave(per).float().to(device))


def preprocess_one(item: np.ndarray, vc: VisionConfig, device: torch.device | str) -> tuple[torch.Tensor,
                                                                                             tuple[int, int, int]]:
    if item.dtype != np.uint8 or item.ndim not in (3, 4) or item.shape[-1] != 3:
        raise ValueError(f"expected RGB uint8 [H, W, 3] or [T, H, W, 3], got {item.dtype} {item.shape}")
    frames = torch.from_numpy(np.ascontiguousarray(item if item.ndim == 4 else item[None]))
    frames = frames.to(device).permute(0, 3, 1, 2)  # [T, 3, H, W] uint8, still 1 byte a value on the way over
    h, w = smart_resize(frames.shape[2], frames.shape[3], vc)
    x = resize_uint8(frames, h, w)
    tp, n = vc.temporal_patch_size, x.shape[0]
    if n == 1:
        x = x.expand(tp, -1, -1, -1)  # an image, repeated in time: a view, copied once by patchify
    elif n % tp:
        x = torch.cat([x, x[-1:].expand(tp - n % tp, -1, -1, -1)])
    rows, grid = patchify(x, vc)  # the one gather copy, on uint8 where the resize gave uint8
    scale, shift = row_affine(vc, rows.device)
    return rows.float().mul_(scale).add_(shift), grid


def preprocess(items: Sequence[np.ndarray], vc: VisionConfig,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Each item RGB uint8 ``[H, W, 3]`` (image) or ``[T, H, W, 3]`` (video) -> (patches
    ``[sum t*h*w, vc.patch_dim]`` float32, grid_thw int64 ``[len(items), 3]``), both on `device`, Qwen2-VL patch
    order. ValueError for a non-RGB-uint8 array or a degenerate size (``smart_resize``)."""
    rows, grids = [], []
    for item in items:
        r, g = preprocess_one(item, vc, device)
        rows.append(r)
        grids.append(g)
    return torch.cat(rows), torch.tensor(grids, dtype=torch.int64, device=device)
