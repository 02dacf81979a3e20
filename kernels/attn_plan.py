"""Attention plans: per-forward metadata shared by the torch reference and the flashinfer path.

The torch reference attends *blocks* (G sequences padded to L queries and N keys each): all decode rows form
one block; prefill rows one more when padding wastes little, else one block per sequence. Plans are built
with tensor ops once per step per layer group and reused by every layer of the group. Semantics (positions,
window, sinks) are in ``kernels.attention``; this module imports neither attention path, so both can depend
on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.kv import kv_slot_mapping, slots_at

# A prefill block is padded to its longest chunk and widest key range; past this waste factor
# (padded score entries / real ones) each prefill sequence gets a block of its own.
PREFILL_PAD_WASTE = 2.0


@dataclass(frozen=True)
class AttnBlock:
    """G sequences attended as one padded batch of L queries x N keys each.

    Padding queries repeat their sequence's last query (so no row is fully masked) and padding keys
    read the sequence's last key slot (always mapped, always finite); both are masked out or dropped."""

    rows: torch.Tensor  # int64 [G, L]: row of each query in the flattened batch
    slots: torch.Tensor  # int64 [G, N]: flat pool slot of each key
    hidden: torch.Tensor  # bool [G, L, N]: True = key NOT visible to the query (masked with -inf)
    dst: torch.Tensor  # int64 [R]: batch row of each real (non-padding) query, in block order
    src: torch.Tensor  # int64 [R]: its index in the block's flattened [G * L] output


@dataclass(frozen=True)
class AttnPlan:
    """Per-forward attention metadata, built once and reused by every layer that shares the page table."""

    blocks: tuple[AttnBlock, ...]
    window_left: int
    page_size: int
    page_table: torch.Tensor
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    write_slots: torch.Tensor  # int64 [T]: flat pool slot of every new token (where its K/V is written)
    identity: bool = False  # one block covering every row in order: its output is the result as is
    kv_start: tuple[int, ...] | None = None  # per sequence, no key left of this position is read (None: 0)

    @property
    def num_tokens(self) -> int:
        return int(self.write_slots.numel())


def _block(table: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, qstart: torch.Tensor, sel: torch.Tensor,
           page_size: int, window_left: int, kv_start: torch.Tensor | None) -> AttnBlock:
    """Block over sequences ``sel`` (int64 indices into the batch)."""
    dev = table.device
    q_s, kv_s, st = q[sel], kv[sel], qstart[sel]
    first = kv_s - q_s
    lo = (first - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(first)
    if kv_start is not None:
        lo = torch.maximum(lo, kv_start[sel])
    n = kv_s - lo
    n_keys, n_q = int(n.max()), int(q_s.max())
    kcol = torch.arange(n_keys, device=dev)
    kvalid = kcol[None, :] < n[:, None]
    kpos = torch.where(kvalid, lo[:, None] + kcol[None, :], (kv_s - 1)[:, None])
    slots = slots_at(table, sel[:, None].expand_as(kpos), kpos, page_size, what="attention read")
    qcol = torch.arange(n_q, device=dev)
    lc = torch.minimum(qcol[None, :], (q_s - 1)[:, None])
    qpos = (first[:, None] + lc)[:, :, None]
    visible = kvalid[:, None, :] & (kpos[:, None, :] <= qpos)
    if window_left >= 0:
        visible &= kpos[:, None, :] >= qpos - window_left
    rows = st[:, None] + lc
    qvalid = (qcol[None, :] < q_s[:, None]).flatten()
    src = torch.nonzero(qvalid).flatten()
    return AttnBlock(rows, slots, ~visible, rows.flatten()[src], src)


def _prefill_groups(q: torch.Tensor, kv: torch.Tensor, sel: torch.Tensor, window_left: int) -> list[torch.Tensor]:
    """One group of all prefill sequences when padding them together wastes little, else one each."""
    if sel.numel() <= 1:
        return [sel] if sel.numel() else []
    q_s, kv_s = q[sel], kv[sel]
    n = kv_s - ((kv_s - q_s - window_left).clamp(min=0) if window_left >= 0 else 0)  # (kv_start only shrinks n)
    padded = sel.numel() * int(q_s.max()) * int(n.max())
    real = int((q_s * n).sum())
    if padded <= PREFILL_PAD_WASTE * real:
        return [sel]
    return list(sel.split(1))


def plan_paged_attention(
    page_table: torch.Tensor, q_lens: Sequence[int], kv_lens: Sequence[int], page_size: int, window_left: int = -1,
    kv_start: Sequence[int] | None = None
) -> AttnPlan:
    """Precompute, for the whole batch, which pool slots each query reads and its causal(+window) mask,
    plus the write slot of every new token. Raises ValueError naming the sequence and logical page
    when a page that must be read or written is unmapped (-1).

    ``kv_start[b]``: keys of sequence b left of this position are neither read nor visible (their pages may
    be -1). An SWA window rebuild uses it: the span's first queries see only the span (see docs/engine.md)."""
    if len(q_lens) != len(kv_lens):
        raise ValueError(f"plan_paged_attention: {len(q_lens)} q_lens but {len(kv_lens)} kv_lens")
    dev = page_table.device
    write = kv_slot_mapping(page_table, q_lens, kv_lens, page_size)
    q = torch.as_tensor(q_lens, dtype=torch.int64, device=dev)
    kv = torch.as_tensor(kv_lens, dtype=torch.int64, device=dev)
    qstart = torch.cumsum(q, 0) - q
    ks = None if kv_start is None else torch.as_tensor(kv_start, dtype=torch.int64, device=dev)
    is_decode = q == 1
    groups = [torch.nonzero(is_decode).flatten()]
    groups += _prefill_groups(q, kv, torch.nonzero(~is_decode).flatten(), window_left)
    blocks = tuple(_block(page_table, q, kv, qstart, g, page_size, window_left, ks) for g in groups if g.numel())
    identity = len(blocks) == 1 and blocks[0].rows.numel() == write.numel() and blocks[0].rows.shape[0] == q.numel()
    return AttnPlan(blocks, window_left, page_size, page_table, tuple(q_lens), tuple(kv_lens), write, identity,
                    None if kv_start is None else tuple(kv_start))
