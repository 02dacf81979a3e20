"""An in-process EncoderAPI (unit tests of gateway / engine pieces only; users always get `services/encoder`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from libs.mm.api import Encoded, EncoderUnavailable
from libs.mm.image import decode_image
from libs.mm.placeholders import content_hash
from libs.mm.preprocess import preprocess
from libs.mm.video import decode_video
from libs.model.vision import VisionTower
from protos.messages import MMKind, WireMMItem


class LocalEncoder:
    def __init__(self, tower: VisionTower, instance_id: str = "local-encoder") -> None:
        self.tower, self.vc, self.instance_id = tower, tower.vc, instance_id
        self.cache: dict[int, tuple[torch.Tensor, tuple[int, int, int]]] = {}

    async def encode(self, request_id: str, kind: MMKind, data: bytes) -> Encoded:
        mm_hash = content_hash(data, kind.value, self.vc)
        cached = mm_hash in self.cache
        if not cached:
            frames = (decode_image(data, self.vc.max_pixels * 64) if kind is MMKind.IMAGE
                      else decode_video(data, self.vc))
            patches, grid = preprocess([frames], self.vc)
            t, h, w = (int(v) for v in grid[0])
            self.cache[mm_hash] = (self.tower(patches, grid), (t, h, w))
        rows, g = self.cache[mm_hash]
        return Encoded(mm_hash, kind, rows.shape[0], g, self.instance_id, cached)

    async def fetch(self, items: Sequence[WireMMItem], dtype: torch.dtype) -> list[torch.Tensor]:
        missing = [i.mm_hash for i in items if i.mm_hash not in self.cache]
        if missing:
            raise EncoderUnavailable(f"embeddings {missing} are not cached")
        return [self.cache[i.mm_hash][0].to(dtype) for i in items]
