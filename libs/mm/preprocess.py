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

from libs.mm.placeholders import grid_thw, smart_resize
from libs.model.vision_config import VisionConfig


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resize_uint8(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``[T, H, W, 3]`` uint8 -> ``[T, height, width, 3]`` on the uint8 grid (rounded, clamped): uint8 on CPU,
    where torch resizes uint8 directly (a fixed-point separable kernel; HWC memory is its fast channels-last
    layout), float on CUDA, which has no uint8 antialiased bicubic (float then rounded: the same up to a level or
    two)."""
    if (height, width) == tuple(frames.shape[1:3]):
        return frames
    x = frames.permute(0, 3, 1, 2)  # NCHW view of HWC memory: channels-last, no copy
    if frames.device.type != "cpu":
        x = x.float()
    x = F.interpolate(x, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    if x.is_floating_point():
        x = x.round_().clamp_(0, 255)
    return x.permute(0, 2, 3, 1)


def patch_rows(x: torch.Tensor, vc: VisionConfig, frames_per_patch: int) -> torch.Tensor:
    """``[T, H, W, 3]`` (T a multiple of `frames_per_patch`) -> float32 ``[t*h*w, 3, frames_per_patch, p, p]`` in
    the Qwen2-VL order, gathered and converted in one copy."""
    m, p = vc.spatial_merge_size, vc.patch_size
    t, gh, gw = x.shape[0] // frames_per_patch, x.shape[1] // p, x.shape[2] // p
    x = x.reshape(t, frames_per_patch, gh // m, m, p, gw // m, m, p, 3).permute(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return x.to(torch.float32, memory_format=torch.contiguous_format).reshape(-1, 3, frames_per_patch, p, p)


def channel_affine(vc: VisionConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) per channel, ``[3, 1, 1, 1]``: ``(v / 255 - mean) / std == v * scale + shift``."""
    std = torch.tensor(vc.image_std, dtype=torch.float64)
    mean = torch.tensor(vc.image_mean, dtype=torch.float64)
    return ((1.0 / (255.0 * std)).float().view(3, 1, 1, 1).to(device),
            (-mean / std).float().view(3, 1, 1, 1).to(device))


def preprocess_one(item: np.ndarray, vc: VisionConfig, device: torch.device | str) -> tuple[torch.Tensor,
                                                                                             tuple[int, int, int]]:
    if item.dtype != np.uint8 or item.ndim not in (3, 4) or item.shape[-1] != 3:
        raise ValueError(f"expected RGB uint8 [H, W, 3] or [T, H, W, 3], got {item.dtype} {item.shape}")
    frames = torch.from_numpy(np.ascontiguousarray(item if item.ndim == 4 else item[None]))
    frames = frames.to(device)  # [T, H, W, 3] uint8: 1 byte a value on the way to the device
    h, w = smart_resize(frames.shape[1], frames.shape[2], vc)
    x = resize_uint8(frames, h, w)
    tp, n = vc.temporal_patch_size, x.shape[0]
    if n > 1 and n % tp:  # a video: padded with its last frame
        x = torch.cat([x, x[-1:].expand(tp - n % tp, -1, -1, -1)])
    # an image is normalised once and repeated in time afterwards (half the arithmetic)
    rows = patch_rows(x, vc, 1 if n == 1 else tp)
    scale, shift = channel_affine(vc, rows.device)
    rows = rows.mul_(scale).add_(shift)
    if n == 1:
        rows = rows.expand(-1, -1, tp, -1, -1)
    t, gh, gw = grid_thw(x.shape[0], h, w, vc)
    return rows.reshape(t * gh * gw, vc.patch_dim), (t, gh, gw)


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
