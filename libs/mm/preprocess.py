"""Preprocessing as torch ops on the encoder's device (CONTRACT STUB: the vision work makes it match the
reference processor and fast): uint8 frames -> resized, normalised, patchified rows for ``VisionTower``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from libs.mm.spec import grid_thw, smart_resize
from libs.model.vision_config import VisionConfig


def preprocess(items: Sequence[np.ndarray], vc: VisionConfig,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Each item RGB uint8 ``[H, W, 3]`` (image) or ``[T, H, W, 3]`` (video) -> (patches
    ``[sum t*h*w, vc.patch_dim]`` float32, grid_thw int64 ``[len(items), 3]``), Qwen2-VL patch order."""
    rows, grids = [], []
    mean = torch.tensor(vc.image_mean, device=device).view(1, 3, 1, 1)
    std = torch.tensor(vc.image_std, device=device).view(1, 3, 1, 1)
    for item in items:
        frames = torch.from_numpy(np.ascontiguousarray(item if item.ndim == 4 else item[None])).to(device)
        x = frames.permute(0, 3, 1, 2).float()  # [T, 3, H, W]
        h, w = smart_resize(x.shape[2], x.shape[3], vc)
        x = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
        x = ((x / 255.0) - mean) / std
        tp = vc.temporal_patch_size
        if x.shape[0] % tp:
            x = torch.cat([x, x[-1:].expand(tp - x.shape[0] % tp, -1, -1, -1)])
        t, gh, gw = grid_thw(x.shape[0], h, w, vc)
        m, p = vc.spatial_merge_size, vc.patch_size
        x = x.reshape(t, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        rows.append(x.reshape(t * gh * gw, vc.patch_dim))
        grids.append((t, gh, gw))
    return torch.cat(rows), torch.tensor(grids, dtype=torch.int64, device=device)
