"""MiMo-V2.5 vision tower (#16) — CONTRACT STUB: shapes and names only; the vision work replaces the body.

``VisionTower(vc).forward(patches, grid_thw)``:
- ``patches`` float ``[sum_i t_i*h_i*w_i, vc.patch_dim]``: every image's / video's patches, flattened in the
  Qwen2-VL processor order (per item: t, then h and w blocked by ``spatial_merge_size`` so that the
  ``merge²`` patches of one LM token are consecutive), values already normalised (``libs/mm`` preprocessing);
- ``grid_thw`` int64 ``[num_items, 3]``;
- returns float ``[sum_i num_tokens_i, vc.out_hidden_size]``: item after item, the rows the LM puts at the
  item's pad positions (``libs.mm.spec.num_tokens``).
"""

from __future__ import annotations

import torch
from torch import nn

from libs.model.vision_config import VisionConfig


class VisionTower(nn.Module):
    def __init__(self, vc: VisionConfig) -> None:
        super().__init__()
        self.vc = vc
        self.patch_embed = nn.Linear(vc.patch_dim, vc.hidden_size, bias=False)
        merged = vc.hidden_size * vc.spatial_merge_size ** 2
        self.merger = nn.Linear(merged, vc.out_hidden_size)

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        h = self.patch_embed(patches.to(self.patch_embed.weight.dtype))
        return self.merger(h.reshape(-1, h.shape[-1] * self.vc.spatial_merge_size ** 2))
