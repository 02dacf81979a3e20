"""Encoder settings (env prefix WINDSERVE_)."""

from __future__ import annotations

from pydantic import Field

from libs.model.vision_config import TINY_VISION_SEED
from libs.service import SenderServiceConfig


class EncoderConfig(SenderServiceConfig):
    """One encoder: dynamic batching of the vision tower, an embedding cache with a byte budget and leases, and
    the input limits it enforces itself (the gateway checks them too; an encoder never trusts its callers).
    `model` empty = the built-in tiny model's vision config (random tower weights, fixed seed)."""

    encoder_device: str = Field(default="cpu", description="torch device of preprocessing and the tower ('cuda' when "
                        "present)")
    encoder_dtype: str = Field(default="float32", pattern=r"^(float32|bfloat16|float16)$",
                               description="tower weights and "
                       "activations")
    tower_seed: int = Field(default=TINY_VISION_SEED,
                            description="seed of the random tower weights (no checkpoint: the "
                      "tiny model; the same tower as libs.model.vision.VisionTower(vc))")
    max_batch_items: int = Field(default=16, ge=1, description="images / videos per tower call at most (1 = no "
                                 "batching)")
    max_batch_patches: int = Field(default=65536, ge=1, description="patches per tower call at most (an item "
                                   "larger than this runs alone)")
    max_wait_ms: float = Field(default=5.0, ge=0, description="longest wait for more items once one is queued")
    prep_threads: int = Field(default=2, ge=1, description="threads decoding and preprocessing inputs")
    video_threads: int = Field(default=2, ge=1, description="threads decoding one video's frames")
    cache_bytes: int = Field(default=2 << 30, ge=0, description="byte budget of the embedding cache (LRU)")
    lease_s: float = Field(default=60.0, ge=0, description="an embedding encoded or hit stays cached at least this "
                           "long (the prefill's fetch must find it), budget or not")
    max_input_bytes: int = Field(default=20 << 20, ge=1, description="largest image / video file accepted")
    max_image_pixels: int = Field(default=40_000_000, ge=1, description="largest decoded image (w*h) accepted")
    max_video_frames: int = Field(default=64, ge=1, description="most sampled frames of one video")
    max_video_seconds: float = Field(default=600.0, gt=0, description="longest video accepted")
