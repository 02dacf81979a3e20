"""MiMo-V2.5 vision tower (#16): a Qwen2.5-VL-style ViT with GQA, MiMo's sliding-band local attention and sinks.

``VisionTower(vc).forward(patches, grid_thw)`` takes every item's normalised patches, flattened in the
Qwen2-VL processor order (``[sum_i t_i*h_i*w_i, vc.patch_dim]``), and ``grid_thw`` int64 ``[num_items, 3]``;
it returns ``[sum_i num_tokens_i, vc.out_hidden_size]`` in the weights' dtype, item after item: the rows the
LM puts at each item's pad positions (``libs.mm.placeholders.num_tokens``). Attention never crosses a frame
(each block attends within the segments of a ``SegmentPlan``), so batching several items gives what each
gives alone, up to float rounding. Parameter names follow the checkpoints (``libs.model.vision_loader``).
Architecture: docs/multimodal.md, "Vision tower".
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from libs.model.layers import RMSNorm
from libs.model.vision_config import TINY_VISION_SEED, VisionConfig

_SCORE_BUDGET = 1 << 25  # float32 scores per chunk in the masked path (128 MiB)


class PatchEmbed(nn.Module):
    def __init__(self, vc: VisionConfig) -> None:
        super().__init__()
        k = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.proj = nn.Conv3d(vc.in_channels, vc.hidden_size, kernel_size=k, stride=k, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1))


@dataclass(frozen=True)
class SegmentPlan:
    """Segments of one attention kind: ``groups`` maps a segment length L to native token indices ``[n, L]``
    (n segments of that length, each in its attention order); ``band`` > 0 limits token i to |i - j| <= band
    within its segment."""

    groups: dict[int, torch.Tensor]
    band: int = 0


def _frame_units(hm: int, wm: int, column_major: bool) -> np.ndarray:
    units = np.arange(hm * wm).reshape(hm, wm)
    return (units.T if column_major else units).reshape(-1)


def _window_units(hm: int, wm: int, ws: int) -> list[np.ndarray]:
    """Qwen2.5-VL window partitions of a merged grid: ws × ws windows, row-major, partial at the bottom/right."""
    units = np.arange(hm * wm).reshape(hm, wm)
    return [units[a:a + ws, b:b + ws].reshape(-1) for a in range(0, hm, ws) for b in range(0, wm, ws)]


def segments(grids: list[tuple[int, int, int]], vc: VisionConfig, kind: str) -> list[np.ndarray]:
    """Native patch indices of every attention segment, in attention order. ``kind``: "full" (a frame),
    "window" (Qwen2.5-VL partitions), "row" / "col" (a frame in row- / column-major merged-token order)."""
    m, u = vc.spatial_merge_size, vc.spatial_merge_size ** 2
    out: list[np.ndarray] = []
    off = 0
    for t, h, w in grids:
        hm, wm = h // m, w // m
        if kind == "window":
            unit_lists = _window_units(hm, wm, vc.window_tokens)
        else:
            unit_lists = [_frame_units(hm, wm, kind == "col")]
        for f in range(t):
            base = off + f * h * w
            out.extend(base + (units[:, None] * u + np.arange(u)).reshape(-1) for units in unit_lists)
        off += t * h * w
    return out


@functools.lru_cache(maxsize=32)  # index tensors: 8 bytes a patch per kind
def cached_plan(grids: tuple[tuple[int, int, int], ...], vc: VisionConfig, kind: str,
                device: torch.device) -> SegmentPlan:
    """`build_plan`, memoised: an encoder sees the same few sizes again and again (its tensors are only read)."""
    return build_plan(list(grids), vc, kind, device)


def build_plan(grids: list[tuple[int, int, int]], vc: VisionConfig, kind: str,
               device: torch.device) -> SegmentPlan:
    by_len: dict[int, list[np.ndarray]] = defaultdict(list)
    for seg in segments(grids, vc, kind):
        by_len[len(seg)].append(seg)
    groups = {n: torch.from_numpy(np.stack(segs)).to(device) for n, segs in by_len.items()}
    return SegmentPlan(groups, vc.sliding_window if kind in ("row", "col") else 0)


def block_kind(vc: VisionConfig, i: int) -> str:
    if i in vc.full_attention_blocks:
        return "full"
    if vc.sliding_window == 0:
        return "window"
    return "col" if vc.column_major(i) else "row"


def _attend_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, band: int,
                   sinks: torch.Tensor | None) -> torch.Tensor:
    """Explicit softmax over ``[n, H, L, D]`` in query chunks, for what SDPA cannot express cheaply: the band mask
    (a chunk of queries [s, e) reads only keys [s - band, e + band)) and the sink column (one logit per head in
    the denominator, no value; as ``kernels.attention``). Scores per chunk stay within ``_SCORE_BUDGET``."""
    n, heads, length, _ = q.shape
    rows = max(1, n * heads)
    chunk = _SCORE_BUDGET // rows - 2 * band if band else _SCORE_BUDGET // (rows * length)
    chunk = max(1, min(length, chunk))
    kf, vf = k.float(), v.float()
    out = torch.empty_like(q)
    for s in range(0, length, chunk):
        e = min(length, s + chunk)
        ks, ke = (max(0, s - band), min(length, e + band)) if band else (0, length)
        sc = torch.matmul(q[:, :, s:e].float(), kf[:, :, ks:ke].transpose(-1, -2)) * scale
        if band:
            far = (torch.arange(s, e, device=q.device)[:, None]
                   - torch.arange(ks, ke, device=q.device)[None, :]).abs() > band
            sc = sc.masked_fill(far, float("-inf"))
        if sinks is not None:
            sink_col = sinks.float().view(1, heads, 1, 1).expand(n, heads, e - s, 1)
            probs = torch.softmax(torch.cat([sc, sink_col], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(sc, dim=-1)
        out[:, :, s:e] = torch.matmul(probs, vf[:, :, ks:ke]).to(q.dtype)
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[S, heads, D]``; cos / sin ``[S, D]`` float32."""
    xf = x.float()
    return (xf * cos[:, None] + _rotate_half(xf) * sin[:, None]).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, vc: VisionConfig, sink: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = vc.num_heads, vc.num_kv_heads, vc.attn_head_dim
        d = self.head_dim
        self.qkv = nn.Linear(vc.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * d, bias=True)
        self.proj = nn.Linear(self.num_heads * d, vc.hidden_size, bias=True)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if sink else None
        self.scale = d ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([h * d, kv * d, kv * d], dim=-1)
        q = apply_rotary(q.view(-1, h, d), cos, sin)
        k = apply_rotary(k.view(-1, kv, d), cos, sin)
        v = v.view(-1, kv, d)
        out = torch.empty_like(q)
        for idx in plan.groups.values():
            out[idx] = self._attend(q[idx], k[idx], v[idx], plan.band)
        return self.proj(out.reshape(-1, h * d))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: int) -> torch.Tensor:
        """``[n, L, heads, D]`` per segment group -> same shape; query head j reads KV head j // (H / KV)."""
        g = self.num_heads // self.num_kv_heads
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        if band or self.sinks is not None:
            o = _attend_masked(q, k, v, self.scale, band, self.sinks)
        else:
            o = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return o.transpose(1, 2)


class VisionMLP(nn.Module):
    def __init__(self, vc: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(vc.hidden_size, vc.intermediate_size, bias=True)
        self.up_proj = nn.Linear(vc.hidden_size, vc.intermediate_size, bias=True)
        self.down_proj = nn.Linear(vc.intermediate_size, vc.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, vc: VisionConfig, full: bool) -> None:
        super().__init__()
        self.norm1 = RMSNorm(vc.hidden_size, vc.rms_norm_eps)
        self.attn = VisionAttention(vc, sink=vc.use_sink and not full)
        self.norm2 = RMSNorm(vc.hidden_size, vc.rms_norm_eps)
        self.mlp = VisionMLP(vc)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, vc: VisionConfig) -> None:
        super().__init__()
        self.merged = vc.hidden_size * vc.spatial_merge_size ** 2
        self.ln_q = RMSNorm(vc.hidden_size, vc.rms_norm_eps)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(),
                                 nn.Linear(self.merged, vc.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.merged))


def rotary_positions(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(row, column) patch coordinates ``[S, 2]`` in the processor's order (merge × merge units row-major)."""
    out = []
    for t, h, w in grids:
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        pos = np.stack([hh, ww], -1).reshape(h // merge, merge, w // merge, merge, 2).transpose(0, 2, 1, 3, 4)
        out.append(np.tile(pos.reshape(-1, 2), (t, 1)))
    return torch.from_numpy(np.concatenate(out))


class VisionTower(nn.Module):
    def __init__(self, vc: VisionConfig, seed: int | None = TINY_VISION_SEED) -> None:
        """Parameters drawn from `seed` (the same values in every process; None leaves torch's default init);
        a tower built under ``torch.device("meta")`` is left uninitialised for the loader."""
        super().__init__()
        self.vc = vc
        self.patch_embed = PatchEmbed(vc)
        self.blocks = nn.ModuleList(VisionBlock(vc, i in vc.full_attention_blocks) for i in range(vc.depth))
        self.merger = PatchMerger(vc)
        if seed is not None and not self.patch_embed.proj.weight.is_meta:
            init_random_(self, seed)

    def rotary(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = rotary_positions(grids, self.vc.spatial_merge_size).to(device)
        # computed here, not held as a buffer: a bf16 tower would otherwise round the frequencies
        freqs = (pos[..., None].float() * rotary_inv_freq(self.vc).to(device)).flatten(1)  # [S, D/2]: rows | cols
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        expect = sum(t * h * w for t, h, w in grids)
        if patches.shape != (expect, self.vc.patch_dim):
            raise ValueError(f"patches {tuple(patches.shape)} do not match grid_thw {grids} "
                             f"(expected ({expect}, {self.vc.patch_dim}))")
        device = self.patch_embed.proj.weight.device
        x = self.patch_embed(patches.to(device))
        cos, sin = self.rotary(grids, device)
        plans: dict[str, SegmentPlan] = {}
        for i, blk in enumerate(self.blocks):
            kind = block_kind(self.vc, i)
            if kind not in plans:
                plans[kind] = cached_plan(tuple(grids), self.vc, kind, device)
            x = blk(x, cos, sin, plans[kind])
        return self.merger(x)


def rotary_inv_freq(vc: VisionConfig) -> torch.Tensor:
    """Frequencies of one axis: half of the head dim rotates by the row index, half by the column index."""
    half = vc.attn_head_dim // 2
    return 1.0 / (vc.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))


def init_random_(tower: VisionTower, seed: int) -> VisionTower:
    """Deterministic init from a CPU generator, parameters in name order: weights ~ N(0, 1/fan_in), biases and
    sinks small, norms 1. The same `seed` gives bit-identical parameters in every process."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(tower.named_parameters()):
            if name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight")):
                value = torch.ones(p.shape)
            elif name.endswith(("bias", "sinks")):
                value = torch.randn(p.shape, generator=gen) * 0.02
            else:
                value = torch.randn(p.shape, generator=gen) * p[0].numel() ** -0.5
            p.copy_(value)
    return tower
