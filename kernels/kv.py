"""KV page scatter/gather.

A pool for one layer is ``[num_pages, page_size, kv_heads, head_dim]``. Position ``p`` of sequence ``b``
lives in page ``page_table[b, p // page_size]`` at slot ``p % page_size``; flattening the pool to
``[num_pages * page_size, kv_heads, head_dim]`` turns that into one flat slot index
``page * page_size + p % page_size``, so scatter and gather are single vectorised index ops.

Slot mapping is built for the whole batch with tensor ops (no per-sequence or per-token Python loop):
the engine pays it once per step per layer group, and on a small model a Python loop over 32+
sequences costs as much as the forward itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def slots_at(page_table: torch.Tensor, seq: torch.Tensor, positions: torch.Tensor, page_size: int, *,
             what: str) -> torch.Tensor:
    """Flat pool slot of ``positions`` (any shape) of sequences ``seq`` (same shape, rows of ``page_table``).

    Raises ValueError naming the first sequence and logical page that is unmapped (-1) or beyond the table."""
    logical = torch.div(positions, page_size, rounding_mode="floor")
    width = page_table.shape[1]
    if logical.numel() and int(logical.max()) >= width:
        bad = int(torch.argmax((logical >= width).flatten().to(torch.int8)))
        raise ValueError(
            f"{what}, sequence {int(seq.flatten()[bad])}: position {int(positions.flatten()[bad])} needs logical "
            f"page {int(logical.flatten()[bad])} but the page table has only {width} columns")
    pages = page_table[seq, logical]
    unmapped = pages < 0
    if bool(unmapped.any()):
        bad = int(torch.argmax(unmapped.flatten().to(torch.int8)))
        raise ValueError(f"{what}, sequence {int(seq.flatten()[bad])}: logical page {int(logical.flatten()[bad])} "
                         f"is unmapped (-1) but holds positions that must be used")
    return pages * page_size + positions % page_size


def new_token_index(q_lens: Sequence[int] | torch.Tensor, kv_lens: Sequence[int] | torch.Tensor,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence of every new token, its position), flattened sequence by sequence, built with tensor ops."""
    q = torch.as_tensor(q_lens, dtype=torch.int64, device=device)
    kv = torch.as_tensor(kv_lens, dtype=torch.int64, device=device)
    seq = torch.repeat_interleave(torch.arange(q.numel(), device=device), q)
    starts = torch.cumsum(q, 0) - q  # row of each sequence's first new token
    pos = (kv - q)[seq] + torch.arange(seq.numel(), device=device) - starts[seq]
    return seq, pos


def kv_slot_mapping(
    page_table: torch.Tensor, q_lens: Sequence[int], kv_lens: Sequence[int], page_size: int, *,
    what: str = "kv write"
) -> torch.Tensor:
    """Flat slot index for every new token of a ragged batch (tokens flattened sequence by sequence)."""
    if len(q_lens) != len(kv_lens):
        raise ValueError(f"{what}: {len(q_lens)} q_lens but {len(kv_lens)} kv_lens")
    seq, pos = new_token_index(q_lens, kv_lens, page_table.device)
    return slots_at(page_table, seq, pos, page_size, what=what)


def scatter_kv(
    k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write new K/V rows ``[T, kv_heads, dim]`` into one layer's pools at flat ``slots`` (in place)."""
    k_pool.view(-1, *k_pool.shape[2:]).index_copy_(0, slots, k.to(k_pool.dtype))
    v_pool.view(-1, *v_pool.shape[2:]).index_copy_(0, slots, v.to(v_pool.dtype))


def gather_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Read K/V rows at flat ``slots`` from one layer's pools."""
    k = k_pool.view(-1, *k_pool.shape[2:]).index_select(0, slots)
    v = v_pool.view(-1, *v_pool.shape[2:]).index_select(0, slots)
    return k, v
