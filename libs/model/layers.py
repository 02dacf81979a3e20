"""MiMo-V2 building blocks: RMSNorm, partial RoPE, paged attention layer, dense SwiGLU MLP, sigmoid MoE.

Parameter names follow the original checkpoint (``q_proj``, ``attention_sink_bias``, ``mlp.gate``...), except
the experts, which are stacked ``[E, ...]`` tensors so the grouped kernel can index them (the loader maps
the per-expert checkpoint tensors onto slices).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import AttnPlan, grouped_moe, paged_attention, scatter_kv, sigmoid_topk_route
from libs.model.compiled import CompiledStep
from libs.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused op, bit-identical to the float32 expression below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class FusedWeight:
    """Row-concatenation of several ``[out_i, in]`` weights so one matmul computes all their projections.

    The parts' ``.data`` become views of the fused tensor, so memory is not doubled and in-place writes to a
    part (loading, ``load_state_dict``) land in the fused tensor too. Whenever a part's storage is replaced
    (``.to()``, ``param.data = ...``) the views no longer line up and the next :meth:`get` rebuilds."""

    def __init__(self) -> None:
        self._fused: torch.Tensor | None = None

    def get(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        if self._fused is None or not self._lines_up(parts):
            self._fused = self._build(parts)
        return self._fused

    def _lines_up(self, parts: Sequence[torch.Tensor]) -> bool:
        fused = self._fused
        assert fused is not None
        ptr, row_bytes = fused.data_ptr(), fused.stride(0) * fused.element_size()
        for p in parts:
            if p.data_ptr() != ptr or p.dtype != fused.dtype or p.device != fused.device:
                return False
            ptr += p.shape[0] * row_bytes
        return True

    @staticmethod
    def _build(parts: Sequence[torch.Tensor]) -> torch.Tensor:
        # built outside inference mode: the parts keep being ordinary (loadable, trainable) parameters
        with torch.inference_mode(False), torch.no_grad():
            fused = torch.cat([p.detach() for p in parts])
            for p, view in zip(parts, fused.split([p.shape[0] for p in parts]), strict=True):
                p.data = view
        return fused


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    freqs = positions.float()[:, None] * inv_freq[None, :].to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: neox ``rotate_half(x) * sin == swap_halves(x) * signed_sin``."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of the first ``cos.shape[-1]`` dims of x ``[T, H, D]``; the rest pass through."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos[:, None] + rotated * sin[:, None], xp], dim=-1)


def apply_partial_rope_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """In-place :func:`apply_partial_rope` (3 ops): x ``[T, H, D]``, cos/sin_signed ``[T, 1, rot]``."""
    rot = cos.shape[-1]
    xr = x[..., :rot]
    swapped = xr.unflatten(-1, (2, rot // 2)).flip(-2).flatten(-2)  # a copy: [x2, x1]
    xr.mul_(cos).addcmul_(swapped, sin_signed)


@dataclass(frozen=True)
class AttnContext:
    """Per-forward, per-layer-type data shared by all layers of that type."""

    cos: torch.Tensor  # [T, 1, rotary_dim]
    sin: torch.Tensor  # [T, 1, rotary_dim], first half negated (see signed_sin)
    plan: AttnPlan
    slots: torch.Tensor  # flat pool slot of each new token (of each row in write_rows when that is set)
    write_rows: torch.Tensor | None = None  # new tokens whose K/V is written (None = all of them)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, is_swa: bool) -> None:
        super().__init__()
        self.is_swa = is_swa
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.kv_heads_swa if is_swa else cfg.kv_heads_full
        self.qk_dim, self.v_dim = cfg.qk_head_dim, cfg.v_head_dim
        self.scale = cfg.qk_head_dim ** -0.5
        self.v_scale = cfg.attention_value_scale
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.qk_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.qk_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.v_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=False)
        has_sinks = cfg.swa_sinks if is_swa else cfg.full_sinks
        self.attention_sink_bias = nn.Parameter(torch.zeros(self.num_heads)) if has_sinks else None
        self._qkv = FusedWeight()
        self.compiled: CompiledStep | None = None  # set by MiMoV2Model.set_compiled

    def forward(self, x: torch.Tensor, ctx: AttnContext, k_pool: torch.Tensor, v_pool: torch.Tensor):
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.qk_dim
        w_qkv = self._qkv.get((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))
        if self.compiled is not None:
            q, k, v = self.compiled.run("qkv_rope", (x, ctx.cos, ctx.sin), w_qkv, hq, hkv, d, self.v_scale)
        else:
            qkv = F.linear(x, w_qkv)
            # q and k heads share head_dim and sit side by side in the fused output: one rotation covers both
            qk = qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d)
            apply_partial_rope_(qk, ctx.cos, ctx.sin)
            q, k = qk.split((hq, hkv), dim=1)
            v = qkv[:, (hq + hkv) * d:].view(t, hkv, self.v_dim) * self.v_scale
        if ctx.write_rows is not None:
            k, v = k.index_select(0, ctx.write_rows), v.index_select(0, ctx.write_rows)
        scatter_kv(k_pool, v_pool, ctx.slots, k, v)
        out = paged_attention(q, k_pool, v_pool, ctx.plan, self.scale, self.attention_sink_bias)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self._gate_up = FusedWeight()
        self.compiled: CompiledStep | None = None  # set by MiMoV2Model.set_compiled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_gate_up = self._gate_up.get((self.gate_proj.weight, self.up_proj.weight))
        if self.compiled is not None:
            return self.compiled.run("swiglu", (x,), w_gate_up, self.down_proj.weight)
        gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class MoEGate(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # kept in float32 like the checkpoint: routing decisions are sensitive to rounding
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias: torch.Tensor
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = MoEGate(cfg)
        self.experts = Experts(cfg)
        self.compiled: CompiledStep | None = None  # set by MiMoV2Model.set_compiled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if self.compiled is not None:
            return self.compiled.run("moe", (x,), self.gate.weight, self.gate.e_score_correction_bias,
                                     self.experts.gate_up_proj, self.experts.down_proj, c.num_experts_per_tok,
                                     c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
        logits = F.linear(x.float(), self.gate.weight.float())
        w, ids = sigmoid_topk_route(logits, self.gate.e_score_correction_bias, c.num_experts_per_tok,
                                    n_group=c.n_group, topk_group=c.topk_group, renormalize=c.norm_topk_prob,
                                    scaling=c.routed_scaling_factor)
        return grouped_moe(x, w, ids, self.experts.gate_up_proj, self.experts.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.is_swa: bool = cfg.layer_is_swa[index]
        pool_layers = cfg.swa_layers if self.is_swa else cfg.full_layers
        self.pool_index: int = pool_layers.index(index)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, self.is_swa)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = MoE(cfg) if cfg.layer_is_moe[index] else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.compiled: CompiledStep | None = None  # set by MiMoV2Model.set_compiled

    def forward(self, h: torch.Tensor, ctx: AttnContext, k_pool: torch.Tensor, v_pool: torch.Tensor):
        attn = self.self_attn(self.input_layernorm(h), ctx, k_pool, v_pool)
        if self.compiled is not None:
            norm = self.post_attention_layernorm
            h, x = self.compiled.run("add_rms_norm", (h, attn), norm.weight, norm.eps)
            return h + self.mlp(x)
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class MTPLayer(nn.Module):
    """One multi-token-prediction block: [enorm(embed(next token)) ; hnorm(hidden)] -> eh_proj -> one SWA
    attention block with a dense MLP -> final_layernorm (the shared lm_head follows)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, is_swa=True)
        self.pre_mlp_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.final_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, emb: torch.Tensor, prev_hidden: torch.Tensor, ctx: AttnContext, k_pool, v_pool):
        h = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(prev_hidden)], dim=-1))
        h = h + self.self_attn(self.input_layernorm(h), ctx, k_pool, v_pool)
        h = h + self.mlp(self.pre_mlp_layernorm(h))
        return self.final_layernorm(h)
