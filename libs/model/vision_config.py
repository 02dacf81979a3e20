"""Vision tower configuration (MiMo-V2.5; Qwen2.5-VL style ViT), parsed from the ``vision_config`` of an HF
``config.json``.

`VisionConfig` covers the patch embedding, ``depth`` blocks with 2-D rotary positions, the
``spatial_merge_size``² merger to ``out_hidden_size``, and local attention in every block except
``full_attention_blocks``: window partitions when ``sliding_window == 0`` (Qwen2.5-VL), else a band of
±``sliding_window`` tokens, row- or column-major per ``window_attn_types``, with sinks (MiMo-V2.5). All
attention stays within one frame of one item. Details: docs/multimodal.md, "Vision tower".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

TINY_VISION_SEED = 16  # the built-in tiny model's random tower weights
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VisionConfig:
    depth: int = 28
    hidden_size: int = 1280
    intermediate_size: int = 4608
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int | None = 64  # MiMo ``qk_channels``; None = hidden_size / num_heads (Qwen2.5-VL)
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 128  # pixels per side of a window partition (Qwen2.5-VL: 112 = 8 merged tokens of 14 px)
    full_attention_blocks: tuple[int, ...] = (0, 9, 18, 27)  # MiMo-V2.5 (REFERENCE.md); Qwen2.5-VL: 7/15/23/31
    sliding_window: int = 64  # >0: ±this many patch tokens (MiMo-V2.5); 0: window partitions (Qwen2.5-VL)
    window_attn_types: tuple[int, ...] = ()  # per block, 1 = column-major token order; () = all row-major
    use_sink: bool = True  # a per-head sink logit in the local-attention blocks (MiMo-V2.5)
    rope_theta: float = 10000.0
    out_hidden_size: int = 4096
    in_channels: int = 3
    rms_norm_eps: float = 1e-6
    min_pixels: int = 32 * 32 * 4
    max_pixels: int = 32 * 32 * 1024
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    video_fps: float = 2.0
    video_max_frames: int = 64

    def __post_init__(self) -> None:
        problems = []
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            problems.append(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            problems.append(f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size}")
        if self.attn_head_dim % 4:
            problems.append(f"head dim {self.attn_head_dim} must be a multiple of 4 (2-D rotary)")
        if self.window_attn_types and len(self.window_attn_types) != self.depth:
            problems.append(f"window_attn_types has {len(self.window_attn_types)} entries for depth {self.depth}")
        if self.sliding_window < 0:
            problems.append(f"sliding_window={self.sliding_window} must be >= 0")
        if any(not 0 <= b < self.depth for b in self.full_attention_blocks):
            problems.append(f"full_attention_blocks {self.full_attention_blocks} outside 0..{self.depth - 1}")
        if self.window_size % self.factor:
            problems.append(f"window_size={self.window_size} must be a multiple of {self.factor}")
        if problems:
            raise ValueError("invalid vision config: " + "; ".join(problems))

    @property
    def factor(self) -> int:
        """Image sides are resized to multiples of this (patch × merge; 32 for MiMo-V2.5)."""
        return self.patch_size * self.spatial_merge_size

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def window_tokens(self) -> int:
        """Merged tokens per side of a window partition (Qwen2.5-VL form)."""
        return self.window_size // self.factor

    def column_major(self, block: int) -> bool:
        """Whether local-attention block `block` runs over the column-major token order (MiMo type 1)."""
        return bool(self.window_attn_types) and self.window_attn_types[block] == 1

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: channels × temporal patch × patch²."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def tiny(cls, out_hidden_size: int = 64) -> VisionConfig:
        """Built-in tiny tower (random weights, fixed seed): 4 blocks, one of them full attention, Qwen2.5-VL
        window partitions of 2×2 merged tokens, GQA 4 heads over 2 KV heads."""
        return cls(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=None,
                   patch_size=8, window_size=32, full_attention_blocks=(3,), sliding_window=0, use_sink=False,
                   out_hidden_size=out_hidden_size, min_pixels=16 * 16 * 4, max_pixels=16 * 16 * 256,
                   video_max_frames=8)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], out_hidden_size: int) -> VisionConfig:
        """From an HF ``vision_config`` (Qwen2.5-VL / MiMo-V2.5 field names); unknown fields keep defaults, except
        the MiMo-only ones (``qk_channels``, ``visual_token_window_size``, ``use_sink``): a config without them is
        Qwen2.5-VL-style (head dim hidden/heads, window partitions, no sinks)."""
        base = cls(out_hidden_size=int(d.get("out_hidden_size", out_hidden_size)), head_dim=None, sliding_window=0,
                   use_sink=False)
        fields: dict[str, Any] = {}
        for ours, theirs in (("depth", "depth"), ("hidden_size", "hidden_size"),
                             ("intermediate_size", "intermediate_size"), ("num_heads", "num_heads"),
                             ("num_kv_heads", "num_key_value_heads"), ("patch_size", "patch_size"),
                             ("temporal_patch_size", "temporal_patch_size"),
                             ("spatial_merge_size", "spatial_merge_size"), ("window_size", "window_size"),
                             ("in_channels", "in_chans"), ("in_channels", "in_channels")):
            if d.get(theirs) is not None:
                fields[ours] = int(d[theirs])
        if "fullatt_block_indexes" in d:
            fields["full_attention_blocks"] = tuple(int(i) for i in d["fullatt_block_indexes"])
        if d.get("qk_channels"):
            fields["head_dim"] = int(d["qk_channels"])
        if int(d.get("visual_token_window_size") or 0) > 0:
            fields["sliding_window"] = int(d["visual_token_window_size"])
        if d.get("vit_window_attn_types"):
            fields["window_attn_types"] = tuple(int(i) for i in d["vit_window_attn_types"])
        if "use_sink" in d:
            fields["use_sink"] = bool(d["use_sink"])
        if "rope_theta" in d:
            fields["rope_theta"] = float(d["rope_theta"])
        if "num_kv_heads" not in fields:
            fields["num_kv_heads"] = fields.get("num_heads", base.num_kv_heads)
        return replace(base, **fields)
