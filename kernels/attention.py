"""Paged attention over a ragged batch (prefill chunks and decode steps mixed), with an optional sliding
window and per-head attention sinks.

Semantics (the torch reference and the flashinfer path agree): sequence ``b``'s ``q_lens[b]`` new tokens sit
at positions ``kv_lens[b]-q_lens[b] .. kv_lens[b]-1`` and all its K/V, already in the pool, is addressed by
``page_table[b]``; a query at ``qp`` sees key ``kp`` iff ``kp <= qp`` and, with a window,
``kp >= qp - window_left`` (HF ``sliding_window`` is ``window_left + 1``); a sink adds one logit per query
head to the softmax denominator and no value. Pages wholly left of every query's window are never read
(they may be ``-1``). Both paths consume the per-step plan of ``kernels.attn_plan``.
"""

from __future__ import annotations

import torch

from kernels.attn_plan import AttnBlock, AttnPlan

# Prefill blocks of at least this many queries use torch's fused CPU attention kernel (`attend_fused`); below
# it the few ops of `attend` cost less than the kernel's set-up.
FUSED_MIN_QUERIES = 16


def _attend_block(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, blk: AttnBlock, scale: float,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """q ``[T, Hq, D]`` -> the block's output ``[G * L, Hq, Dv]`` (float32)."""
    g_seqs, n_q = blk.rows.shape
    qb = q.index_select(0, blk.rows.flatten()) if n_q > 1 or blk.rows.shape[0] != q.shape[0] else q
    if n_q >= FUSED_MIN_QUERIES and not q.is_cuda and k_flat.shape[-1] == v_flat.shape[-1]:
        return attend_fused(qb, k_flat, v_flat, blk.slots, blk.hidden, scale, sinks)
    return attend(qb, k_flat, v_flat, blk.slots, blk.hidden, scale, sinks)


def attend_fused(qb: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor,
                 hidden: torch.Tensor, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """`attend` through torch's fused (flash) CPU attention, which never holds the [L, N] scores of every head at
    once. It returns each row's log-sum-exp too, so a sink is applied afterwards: with the sink's logit in the
    denominator the output is the sink-free one times sigmoid(lse - sink). Needs Dv == D (the kernel's shape)."""
    g_seqs, n_q, n_keys = hidden.shape
    hq, hkv = qb.shape[1], k_flat.shape[1]
    flat = slots.flatten()
    qh = qb.float().view(g_seqs, n_q, hq, -1).transpose(1, 2)  # [G, Hq, L, D]

    def heads(x: torch.Tensor) -> torch.Tensor:  # [G, Hq, N, D]: query head h reads KV head h // (Hq / Hkv)
        x = x.index_select(0, flat).float().view(g_seqs, n_keys, hkv, 1, -1)
        return x.expand(-1, -1, -1, hq // hkv, -1).reshape(g_seqs, n_keys, hq, -1).transpose(1, 2)

    mask = torch.zeros(g_seqs, 1, n_q, n_keys, device=qb.device).masked_fill_(hidden[:, None], float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qh, heads(k_flat), heads(v_flat), 0.0, False, attn_mask=mask, scale=scale)
    if sinks is not None:
        out = out * torch.sigmoid(lse - sinks.float()[None, :, None])[..., None]
    return out.transpose(1, 2).reshape(g_seqs * n_q, hq, -1)


def attend(qb: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor, hidden: torch.Tensor,
           scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """The block's queries qb ``[G * L, Hq, D]`` (sequence-major) over keys at flat pool `slots` ``[G, N]`` with
    `hidden` ``[G, L, N]`` masked -> ``[G * L, Hq, Dv]`` (float32). GQA: the g query heads of a KV head are folded
    into the query axis, so K/V are never repeated per query head. Tensors only (the compiled step calls it)."""
    g_seqs, n_q, n_keys = hidden.shape
    hq, hkv = qb.shape[1], k_flat.shape[1]
    g = hq // hkv
    qb = qb.float().view(g_seqs, n_q, hkv, g, -1).permute(0, 2, 3, 1, 4).reshape(g_seqs, hkv, g * n_q, -1)
    flat = slots.flatten()
    k = k_flat.index_select(0, flat).float().view(g_seqs, n_keys, hkv, -1).permute(0, 2, 3, 1)  # [G, Hkv, D, N]
    scores = torch.matmul(qb, k).mul_(scale).view(g_seqs, hkv, g, n_q, n_keys)
    scores.masked_fill_(hidden[:, None, None], float("-inf"))
    if sinks is not None:
        sink_col = sinks.float().view(1, hkv, g, 1, 1).expand(g_seqs, hkv, g, n_q, 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    v = v_flat.index_select(0, flat).float().view(g_seqs, n_keys, hkv, -1).transpose(1, 2)  # [G, Hkv, N, Dv]
    out = torch.matmul(probs.reshape(g_seqs, hkv, g * n_q, n_keys), v)  # [G, Hkv, g*L, Dv]
    return out.view(g_seqs, hkv, g, n_q, -1).permute(0, 3, 1, 2, 4).reshape(g_seqs * n_q, hq, -1)


def paged_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: AttnPlan, scale: float,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference: q ``[T, Hq, D]``, pools ``[pages, page_size, Hkv, D|Dv]`` -> ``[T, Hq, Dv]``.

    One gather + two batched matmuls per block (usually one or two blocks per step)."""
    k_flat = k_pool.view(-1, *k_pool.shape[2:])
    v_flat = v_pool.view(-1, *v_pool.shape[2:])
    if plan.identity:
        return _attend_block(q, k_flat, v_flat, plan.blocks[0], scale, sinks).to(q.dtype)
    out = q.new_empty(q.shape[0], q.shape[1], v_pool.shape[-1])
    for blk in plan.blocks:
        res = _attend_block(q, k_flat, v_flat, blk, scale, sinks)
        out.index_copy_(0, blk.dst, res.index_select(0, blk.src).to(q.dtype))
    return out


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: AttnPlan, scale: float,
                    sinks: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Dispatch: flashinfer on CUDA when installed (``backend='auto'|'flashinfer'``), else the torch reference."""
    if backend == "torch" or (backend == "auto" and (plan.kv_start is not None or not _flashinfer_usable(q))):
        # (a window rebuild's kv_start is a torch-reference feature: flashinfer's plan has no key floor)
        return paged_attention_ref(q, k_pool, v_pool, plan, scale, sinks)
    from kernels.flashinfer_attn import paged_attention_flashinfer

    return paged_attention_flashinfer(q, k_pool, v_pool, plan, scale, sinks)


def _flashinfer_usable(q: torch.Tensor) -> bool:
    if not q.is_cuda:
        return False
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True
