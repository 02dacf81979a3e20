"""Attention plans: per-forward metadata shared by the torch reference and the flashinfer path.

The torch reference attends *blocks* (G entries padded to L queries and N keys each): all decode rows form
one block; prefill chunks are cut into query tiles (each reads only the keys its queries see), grouped into
blocks that pad little. Plans are built
with tensor ops once per step per layer group and reused by every layer of the group. Semantics (positions,
window, sinks) are in ``kernels.attention``; this module imports neither attention path, so both can depend
on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.kv import kv_slot_mapping, slots_at

# A prefill block is padded to its longest tile and widest key range; tiles join a block while the padded score
# entries stay within this factor of the real ones.
PREFILL_PAD_WASTE = 1.25
# Prefill chunks are attended in query tiles of this many queries (`_tiles`)
PREFILL_TILE = 128


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
           page_size: int, window_left: int, kv_start: torch.Tensor | None, seq: torch.Tensor) -> AttnBlock:
    """Block over entries ``sel`` (int64 indices into q / kv / qstart: sequences, or query tiles of them);
    ``seq`` maps an entry to its sequence (its page-table row)."""
    dev = table.device
    q_s, kv_s, st, row = q[sel], kv[sel], qstart[sel], seq[sel]
    first = kv_s - q_s
    lo = (first - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(first)
    if kv_start is not None:
        lo = torch.maximum(lo, kv_start[row])
    n = kv_s - lo
    n_keys, n_q = int(n.max()), int(q_s.max())
    kcol = torch.arange(n_keys, device=dev)
    kvalid = kcol[None, :] < n[:, None]
    kpos = torch.where(kvalid, lo[:, None] + kcol[None, :], (kv_s - 1)[:, None])
    slots = slots_at(table, row[:, None].expand_as(kpos), kpos, page_size, what="attention read")
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


def _tiles(q: torch.Tensor, kv: torch.Tensor, qstart: torch.Tensor, sel: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prefill sequences `sel` cut into query tiles of at most PREFILL_TILE queries: (q, kv, qstart, seq) of
    each tile. A tile reads only the keys its own queries can see (causal, windowed), so a long chunk under a
    window reads O(window) keys per query instead of the whole chunk's range, and a causal chunk about half."""
    q_s = q[sel]
    n_tiles = (q_s + PREFILL_TILE - 1) // PREFILL_TILE
    seq = sel.repeat_interleave(n_tiles)
    tile = torch.arange(int(n_tiles.sum()), device=q.device) - (torch.cumsum(n_tiles, 0) - n_tiles).repeat_interleave(
        n_tiles)
    offset = tile * PREFILL_TILE
    tq = torch.clamp(q[seq] - offset, max=PREFILL_TILE)
    return tq, kv[seq] - q[seq] + offset + tq, qstart[seq] + offset, seq


def _prefill_groups(q: torch.Tensor, kv: torch.Tensor, window_left: int) -> list[torch.Tensor]:
    """Prefill entries (all of q / kv) in groups padded together: in order of key range, a group grows while its
    padded score entries stay within PREFILL_PAD_WASTE of the real ones."""
    if q.numel() <= 1:
        return [torch.arange(q.numel(), device=q.device)] if q.numel() else []
    n = kv - ((kv - q - window_left).clamp(min=0) if window_left >= 0 else 0)  # (kv_start only shrinks n)
    order = torch.argsort(n, stable=True).tolist()
    ql, nl = q.tolist(), n.tolist()
    groups: list[list[int]] = [[]]
    max_q = max_n = real = 0
    for e in order:
        mq, mn, r = max(max_q, ql[e]), max(max_n, nl[e]), real + ql[e] * nl[e]
        if groups[-1] and (len(groups[-1]) + 1) * mq * mn > PREFILL_PAD_WASTE * r:
            groups.append([])
            mq, mn, r = ql[e], nl[e], ql[e] * nl[e]
        groups[-1].append(e)
        max_q, max_n, real = mq, mn, r
    return [torch.tensor(g, dtype=torch.int64, device=q.device) for g in groups]


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
    decode = torch.nonzero(is_decode).flatten()
    blocks = [_block(page_table, q, kv, qstart, decode, page_size, window_left, ks, torch.arange(q.numel(), device=dev))
              ] if decode.numel() else []
    tq, tkv, tstart, tseq = _tiles(q, kv, qstart, torch.nonzero(~is_decode).flatten())
    blocks += [_block(page_table, tq, tkv, tstart, g, page_size, window_left, ks, tseq)
               for g in _prefill_groups(tq, tkv, window_left)]
    identity = len(blocks) == 1 and blocks[0].rows.numel() == write.numel() and bool(
        (blocks[0].rows.flatten() == torch.arange(write.numel(), device=dev)).all())
    return AttnPlan(tuple(blocks), window_left, page_size, page_table, tuple(q_lens), tuple(kv_lens), write, identity,
                    None if kv_start is None else tuple(kv_start))
