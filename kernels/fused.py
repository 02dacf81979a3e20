"""The decoder's parts as plain functions of tensors, written for `torch.compile` (inductor fuses each into a few
generated kernels; `libs/model/compiled.py` compiles and calls them).

Each is the same math as the eager modules in `libs/model/layers.py` (the eager path stays the reference):
:func:`qkv_rope`, :func:`add_rms_norm`, :func:`swiglu`, :func:`moe` (indexed reductions over the chosen
experts' weights up to :data:`GATHER_MAX_TOKENS` tokens, the opaque :func:`grouped_moe_op` beyond) and
:func:`decode_attention` (after :data:`kv_write`, the one opaque op that writes the new K/V in place).
Functions take only tensors, ints, floats and bools, so one compiled graph serves every layer of the same
shapes; tensors whose first dimension is the step's token count come first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.moe import grouped_moe, sigmoid_topk_route

# The gathered expert pass reads k experts per token; the grouped one reads each chosen expert once. Past
# 16 tokens (top-2 of 16 experts: every expert is likely chosen) the grouped pass reads less.
GATHER_MAX_TOKENS = 16
# Inductor's CPU code sums more than this many floats in chunks (a cascade, for accuracy) and guards the length: a
# decode step whose sequences reach past it runs a graph of its own (warmed up where the engine holds such lengths).
LONG_DECODE_KEYS = 4096


# Ops the compiler calls without tracing into them, registered on the dispatcher directly: a
# `torch.library.custom_op` wrapper costs ~70 us a call here, the dispatcher's own path a few.
_LIB = torch.library.Library("windserve", "FRAGMENT")


def _op(schema: str, impl, fake):
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"windserve::{name}", fake, lib=_LIB)
    return getattr(torch.ops.windserve, name).default


def _grouped_moe_fake(x, weights, ids, gate_up, down):
    return torch.empty_like(x)


def _kv_write(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, plane: int,
              write_slots: torch.Tensor) -> None:
    hkv = k.shape[1]
    k_buf[plane].view(-1, hkv, k_buf.shape[-1]).index_copy_(0, write_slots, k.to(k_buf.dtype))
    v_buf[plane].view(-1, hkv, v_buf.shape[-1]).index_copy_(0, write_slots, v.to(v_buf.dtype))


def _kv_write_fake(k, v, k_buf, v_buf, plane, write_slots) -> None:
    return None


grouped_moe_op = _op("grouped_moe(Tensor x, Tensor weights, Tensor ids, Tensor gate_up, Tensor down) -> Tensor",
                     grouped_moe, _grouped_moe_fake)
"""`kernels.moe.grouped_moe` as an opaque op (its token counts per expert are data-dependent)."""

kv_write = _op("kv_write(Tensor k, Tensor v, Tensor(a!) k_buf, Tensor(b!) v_buf, int plane, Tensor write_slots) -> ()",
               _kv_write, _kv_write_fake)
"""Write k / v ``[T, Hkv, D]`` at flat `write_slots` of plane `plane` of the KV buffers
(`libs.model.paged.KVPools.layer_base`), in place. Opaque, because it writes in place: traced, the compiler
copies the whole buffer to write a few rows."""


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     plane: int, write_slots: torch.Tensor, slots: torch.Tensor, hidden: torch.Tensor, scale: float,
                     sinks: torch.Tensor | None) -> torch.Tensor:
    """One decode token per sequence: write k / v ``[B, Hkv, D]`` at `write_slots` (`kv_write`) and attend q
    ``[B, Hq, D]`` over the keys at `slots` ``[B, N]`` (flat slots of plane `plane` of the KV buffers, seen as
    [rows x page, Hkv, D]) with `hidden` ``[B, 1, N]`` masked, a sink's logit in the softmax denominator. Written as
    reductions over the indexed keys and values (``k_buf[...][slots]``): compiled, the index is fused into them,
    so no key is gathered into a copy."""
    kv_write(k, v, k_buf, v_buf, plane, write_slots)
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    kk = k_buf[plane].view(-1, hkv, d)[slots].float()  # [B, N, Hkv, D]
    vv = v_buf[plane].view(-1, hkv, v_buf.shape[-1])[slots].float()
    scores = (kk[:, :, :, None, :] * q.float().view(b, 1, hkv, g, d)).sum(-1) * scale  # [B, N, Hkv, g]
    scores = scores.masked_fill(hidden[:, 0, :, None, None], float("-inf"))
    m = scores.amax(1, keepdim=True)
    if sinks is not None:
        sink = sinks.float().view(1, 1, hkv, g)
        m = torch.maximum(m, sink)
    e = torch.exp(scores - m)
    denom = e.sum(1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - m)
    p = e / denom
    out = (p[..., None] * vv[:, :, :, None, :]).sum(1)  # [B, Hkv, g, Dv]
    return out.reshape(b, hq, -1).to(q.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def qkv_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, w_qkv: torch.Tensor, hq: int, hkv: int,
             d: int, v_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x ``[T, hidden]`` (normed) -> q ``[T, hq, d]``, k ``[T, hkv, d]`` (rotated), v ``[T, hkv, dv]`` (scaled).
    cos / sin_signed ``[T, 1, rot]`` as `libs.model.layers.apply_partial_rope_` takes them."""
    t = x.shape[0]
    qkv = F.linear(x, w_qkv)
    qk = qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d)
    rot = cos.shape[-1]
    xr = qk[..., :rot]
    swapped = xr.unflatten(-1, (2, rot // 2)).flip(-2).flatten(-2)
    qk = torch.cat([xr * cos + swapped * sin_signed, qk[..., rot:]], dim=-1)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, -1) * v_scale
    return qk[:, :hq], qk[:, hq:], v


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta))."""
    h = h + delta
    return h, rms_norm(h, weight, eps)


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


def moe(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
        top_k: int, n_group: int, topk_group: int, renormalize: bool, scaling: float) -> torch.Tensor:
    """Sigmoid top-k routing (`kernels.moe.sigmoid_topk_route`) and the SwiGLU experts."""
    w, ids = sigmoid_topk_route(F.linear(x.float(), gate_w.float()), bias, top_k, n_group=n_group,
                                topk_group=topk_group, renormalize=renormalize, scaling=scaling)
    if x.shape[0] > GATHER_MAX_TOKENS:
        return grouped_moe_op(x, w, ids, gate_up, down)
    gate, up = (gate_up[ids] * x[:, None, None, :]).sum(-1).chunk(2, dim=-1)  # [T, k, I] each
    y = (down[ids] * (F.silu(gate) * up)[:, :, None, :]).sum(-1)  # [T, k, hidden]
    return (y * w.to(x.dtype)[..., None]).sum(1)
