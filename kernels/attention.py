"""Paged attention over a ragged batch (prefill chunks and decode steps mixed), with an optional sliding
window and per-head attention sinks.

Semantics (shared by the torch reference and the flashinfer path):

* sequence ``b`` has ``q_lens[b]`` new tokens at positions ``kv_lens[b]-q_lens[b] .. kv_lens[b]-1``; all of
  its K/V (cached prefix + the new tokens, already scattered into the pool) are addressed by
  ``page_table[b]``;
* query at position ``qp`` sees key ``kp`` iff ``kp <= qp`` and, with a window, ``kp >= qp - window_left``
  (flashinfer's ``window_left``; HF ``sliding_window`` is ``window_left + 1``);
* a sink adds one logit per query head to the softmax denominator and no value (gpt-oss / MiMo style).

Pages wholly to the left of every query's window are never read, so they may be ``-1`` in the table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv import flat_slots


@dataclass(frozen=True)
class SeqPlan:
    """What one sequence reads: flat pool slots of its visible keys and the query/key visibility mask."""

    q_start: int  # row of its first new token in the flattened batch
    q_len: int
    slots: torch.Tensor  # int64 [n_keys]
    mask: torch.Tensor  # bool [q_len, n_keys], True = visible


@dataclass(frozen=True)
class AttnPlan:
    """Per-forward attention metadata, built once and reused by every layer that shares the page table."""

    seqs: tuple[SeqPlan, ...]
    window_left: int
    page_size: int
    page_table: torch.Tensor
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    # decode-only batches (every q_len == 1) are attended in one padded batched matmul instead of a loop
    decode_slots: torch.Tensor | None = None  # int64 [B, max_keys], padded with slot 0
    decode_mask: torch.Tensor | None = None  # bool [B, max_keys]


def _decode_padding(seqs: list[SeqPlan]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(s.slots.numel() for s in seqs)
    slots = torch.zeros(len(seqs), width, dtype=torch.int64, device=seqs[0].slots.device)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool, device=seqs[0].slots.device)
    for b, s in enumerate(seqs):
        slots[b, :s.slots.numel()] = s.slots
        mask[b, :s.slots.numel()] = s.mask[0]
    return slots, mask


def _seq_plan(row: torch.Tensor, q_start: int, q_len: int, kv_len: int, page_size: int, window_left: int,
              b: int) -> SeqPlan:
    first_q = kv_len - q_len
    lo = 0 if window_left < 0 else max(0, first_q - window_left)
    kpos = torch.arange(lo, kv_len, device=row.device)
    qpos = torch.arange(first_q, kv_len, device=row.device)
    mask = kpos[None, :] <= qpos[:, None]
    if window_left >= 0:
        mask &= kpos[None, :] >= (qpos[:, None] - window_left)
    slots = flat_slots(row, kpos, page_size, what=f"attention read, sequence {b}")
    return SeqPlan(q_start=q_start, q_len=q_len, slots=slots, mask=mask)


def plan_paged_attention(
    page_table: torch.Tensor, q_lens: list[int], kv_lens: list[int], page_size: int, window_left: int = -1
) -> AttnPlan:
    """Precompute which pool slots each sequence reads and its causal(+window) mask."""
    seqs = []
    q_start = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        seqs.append(_seq_plan(page_table[b], q_start, q_len, kv_len, page_size, window_left, b))
        q_start += q_len
    padded = _decode_padding(seqs) if seqs and all(q == 1 for q in q_lens) else (None, None)
    return AttnPlan(tuple(seqs), window_left, page_size, page_table, tuple(q_lens), tuple(kv_lens), *padded)


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                sinks: torch.Tensor | None) -> torch.Tensor:
    """q [L, Hq, D], k [N, Hkv, D], v [N, Hkv, Dv] -> [L, Hq, Dv], GQA by grouping query heads per KV head."""
    L, hq, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qg = q.view(L, hkv, g, -1).permute(1, 2, 0, 3)  # [Hkv, G, L, D]
    scores = torch.matmul(qg.float(), k.permute(1, 2, 0).float()[:, None]) * scale  # [Hkv, G, L, N]
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink_col = sinks.float().view(hkv, g, 1, 1).expand(hkv, g, L, 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.permute(1, 0, 2).float()[:, None])  # [Hkv, G, L, Dv]
    return out.permute(2, 0, 1, 3).reshape(L, hq, -1).to(q.dtype)


def paged_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: AttnPlan, scale: float,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference: q ``[T, Hq, D]``, pools ``[pages, page_size, Hkv, D|Dv]`` -> ``[T, Hq, Dv]``.

    Loops over sequences only; each sequence's keys are fetched with one vectorised gather.
    """
    k_flat = k_pool.view(-1, *k_pool.shape[2:])
    v_flat = v_pool.view(-1, *v_pool.shape[2:])
    if plan.decode_slots is not None:
        return _decode_batched(q, k_flat, v_flat, plan, scale, sinks)
    out = q.new_empty(q.shape[0], q.shape[1], v_pool.shape[-1])
    for s in plan.seqs:
        k = k_flat.index_select(0, s.slots)
        v = v_flat.index_select(0, s.slots)
        rows = slice(s.q_start, s.q_start + s.q_len)
        out[rows] = _attend_one(q[rows], k, v, s.mask, scale, sinks)
    return out


def _decode_batched(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, plan: AttnPlan, scale: float,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """One query per sequence: gather every sequence's keys into a padded [B, N] block and attend at once."""
    assert plan.decode_slots is not None and plan.decode_mask is not None
    b, hq, _ = q.shape
    n = plan.decode_slots.shape[1]
    k = k_flat.index_select(0, plan.decode_slots.reshape(-1)).view(b, n, *k_flat.shape[1:])  # [B, N, Hkv, D]
    v = v_flat.index_select(0, plan.decode_slots.reshape(-1)).view(b, n, *v_flat.shape[1:])
    hkv = k.shape[2]
    g = hq // hkv
    qg = q.view(b, hkv, g, -1).float()  # [B, Hkv, G, D]
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1).float()) * scale  # [B, Hkv, G, N]
    scores = scores.masked_fill(~plan.decode_mask[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink_col = sinks.float().view(1, hkv, g, 1).expand(b, hkv, g, 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3).float())  # [B, Hkv, G, Dv]
    return out.reshape(b, hq, -1).to(q.dtype)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: AttnPlan, scale: float,
                    sinks: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Dispatch: flashinfer on CUDA when installed (``backend='auto'|'flashinfer'``), else the torch reference."""
    if backend == "torch" or (backend == "auto" and not _flashinfer_usable(q)):
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
