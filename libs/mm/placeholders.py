"""Pure multimodal arithmetic shared by gateway, encoder, router and workers.

Every image pad is the same token id, so prompts with different images would share block hashes and KV.
windserve therefore sends the *hash view* of a prompt everywhere (gateway → router → prefill → decode →
GCache): pad position k of item ``mm_hash`` carries the pseudo token ``mm_token(mm_hash, k)`` (bit 31 set,
never a vocabulary id), so block hashes, KV events, the router's index, GCache keys and the hand-off tell
images apart unchanged. Only the model runner maps pseudo tokens back (``WireMMItem`` says where).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import xxhash

from libs.model.vision_config import VisionConfig

MM_TOKEN_FLAG = 1 << 31
MM_HASH_SEED = 0x5EED_1A6E  # content hashes (and pseudo tokens) are xxh64 with this fixed seed


def mm_token(mm_hash: int, k: int) -> int:
    """Pseudo token of the k-th embedding row of item `mm_hash` (uint32 with bit 31 set)."""
    return MM_TOKEN_FLAG | (xxhash.xxh64_intdigest(struct.pack("<QI", mm_hash, k), MM_HASH_SEED) & 0x7FFF_FFFF)


def is_mm_token(token: int) -> bool:
    return token >= MM_TOKEN_FLAG


def content_hash(data: bytes, kind: str, vc: VisionConfig) -> int:
    """xxh64 of the input bytes plus what changes the embedding (kind, pixel budget, patching, normalisation):
    equal inputs under equal preprocessing share one cache entry; anything else never collides by design."""
    params = repr((kind, vc.patch_size, vc.temporal_patch_size, vc.spatial_merge_size, vc.min_pixels,
                   vc.max_pixels, vc.image_mean, vc.image_std, vc.video_fps, vc.video_max_frames)).encode()
    h = xxhash.xxh64(params, MM_HASH_SEED)
    h.update(data)
    return h.intdigest()


def smart_resize(height: int, width: int, vc: VisionConfig) -> tuple[int, int]:
    """Qwen2-VL's rule: sides rounded to multiples of ``vc.factor``, area kept within [min_pixels, max_pixels]
    with the aspect ratio (nearly) kept. Raises ValueError on an empty or degenerate (aspect > 200) image."""
    f = vc.factor
    if height <= 0 or width <= 0:
        raise ValueError(f"image of {width}x{height} pixels is empty")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image of {width}x{height} pixels: aspect ratio over 200")
    h = max(f, round(height / f) * f)
    w = max(f, round(width / f) * f)
    if h * w > vc.max_pixels:
        beta = math.sqrt(height * width / vc.max_pixels)
        h = max(f, math.floor(height / beta / f) * f)
        w = max(f, math.floor(width / beta / f) * f)
    elif h * w < vc.min_pixels:
        beta = math.sqrt(vc.min_pixels / (height * width))
        h = math.ceil(height * beta / f) * f
        w = math.ceil(width * beta / f) * f
    return h, w


def grid_thw(frames: int, height: int, width: int, vc: VisionConfig) -> tuple[int, int, int]:
    """Patch grid (t, h, w) of `frames` frames already resized to (height, width): an image is 1 frame,
    duplicated to ``temporal_patch_size``; a video's frame count is rounded up to a multiple of it."""
    t = max(1, math.ceil(frames / vc.temporal_patch_size))
    return t, height // vc.patch_size, width // vc.patch_size


def num_tokens(grid: Sequence[int], vc: VisionConfig) -> int:
    """LM tokens (merged patches) of a grid: t · h · w / merge²."""
    t, h, w = grid
    return t * h * w // vc.spatial_merge_size ** 2


def hash_view(token_ids: Sequence[int], items: Sequence[tuple[int, int, int]]) -> list[int]:
    """`token_ids` with the pad positions of each (mm_hash, offset, num_tokens) item replaced by pseudo tokens."""
    out = list(token_ids)
    for mm_hash, offset, n in items:
        if offset < 0 or offset + n > len(out):
            raise ValueError(f"multimodal item at [{offset}, {offset + n}) outside a prompt of {len(out)} tokens")
        out[offset:offset + n] = [mm_token(mm_hash, k) for k in range(n)]
    return out


def model_token_ids(ids, pad_id: int):
    """Token-id tensor with every pseudo token replaced by the model's pad id (`pad_id`): what the embedding layer
    may look up. The rows at those positions are then overwritten by the tower's embeddings."""
    return ids.masked_fill(ids >= MM_TOKEN_FLAG, pad_id)
