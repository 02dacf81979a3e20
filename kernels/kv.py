"""KV page scatter/gather.

A pool for one layer is ``[num_pages, page_size, kv_heads, head_dim]``. Position ``p`` of sequence ``b``
lives in page ``page_table[b, p // page_size]`` at slot ``p % page_size``; flattening the pool to
``[num_pages * page_size, kv_heads, head_dim]`` turns that into one flat slot index
``page * page_size + p % page_size``, so scatter and gather are single vectorised index ops.
"""

from __future__ import annotations

import torch


def flat_slots(page_table_row: torch.Tensor, positions: torch.Tensor, page_size: int, *, what: str) -> torch.Tensor:
    """Flat pool slot of each position of one sequence; raises if a needed page is unmapped (-1)."""
    logical = positions // page_size
    if logical.numel() and int(logical.max()) >= page_table_row.numel():
        raise ValueError(
            f"{what}: position {int(positions.max())} needs logical page {int(logical.max())} but the page table "
            f"has only {page_table_row.numel()} columns"
        )
    pages = page_table_row[logical]
    if pages.numel() and bool((pages < 0).any()):
        bad = int(logical[pages < 0][0])
        raise ValueError(f"{what}: logical page {bad} is unmapped (-1) but holds positions that must be used")
    return pages * page_size + positions % page_size


def kv_slot_mapping(
    page_table: torch.Tensor, q_lens: list[int], kv_lens: list[int], page_size: int, *, what: str = "kv write"
) -> torch.Tensor:
    """Flat slot index for every new token of a ragged batch (tokens flattened sequence by sequence)."""
    slots = []
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        pos = torch.arange(kv_len - q_len, kv_len, device=page_table.device)
        slots.append(flat_slots(page_table[b], pos, page_size, what=f"{what}, sequence {b}"))
    if not slots:
        return torch.empty(0, dtype=torch.int64, device=page_table.device)
    return torch.cat(slots)


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
