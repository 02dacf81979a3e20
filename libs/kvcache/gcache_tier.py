"""GCache (L3) bookkeeping that needs no IO: which hit an L3 lookup takes, and what L3 stores per cached token.

Values (docs/kvcache.md, "Engine integration (L3)"): per page-aligned block b a *full value* (the block's page of
every full-attention layer, K and V) and, at the blocks where a written sequence ended and (optionally) every
`checkpoint_every_pages` pages, an *SWA checkpoint* (the SWA layers' K and V of the window's pages ending at b:
min(window pages, b + 1) pages). A hit ending at block m is valid when the full values of every block up to m
and the checkpoint at m exist.
"""

from __future__ import annotations

from collections.abc import Sequence

from libs.kvcache.config import KVLayout


def l3_hit_end(local_pages: int, full_present: Sequence[bool], swa_present: Sequence[bool], window_pages: int,
               max_pages: int) -> int:
    """End page (exclusive) of the longest valid L3 hit beyond the local tree's `local_pages`, or 0 (none).

    `full_present[j]` / `swa_present[j]`: block j's full value / checkpoint is in L3 (indexed from block 0).
    The hit ending at page `end` needs the full values of blocks local_pages..end-1, the checkpoint at block
    end-1, and its window [max(0, end - window_pages), end) inside the imported blocks (the local pages before
    may hold no SWA KV there; importing only such hits is the simplest correct rule). `max_pages`: the most
    pages a hit may have (a hit stays below the prompt's last token)."""
    best = 0
    j = local_pages
    limit = min(max_pages, len(full_present), len(swa_present))
    while j < limit and full_present[j]:
        end = j + 1
        if swa_present[j] and max(0, end - window_pages) >= local_pages:
            best = end
        j += 1
    return best


def l3_checkpoint_ends(pages: int, every_pages: int) -> list[int]:
    """End pages (exclusive) of the SWA checkpoints a write-back of a sequence's first `pages` computed pages
    stores: every multiple of `every_pages` up to `pages` (0: none), and `pages` itself (the window the sequence
    holds when it finishes), ascending. The engine stores one only where its window's pages still hold SWA KV
    (the cache's retention kept them: `KVCacheConfig.checkpoint_every_pages`, docs/kvcache.md), see
    `l3_checkpoints`; a periodic checkpoint lets a later prompt that shares only a mid-prompt prefix hit."""
    if pages <= 0:
        return []
    ends = list(range(every_pages, pages, every_pages)) if every_pages > 0 else []
    return [*ends, pages]


def l3_checkpoints(swa_table: Sequence[int], pages: int, window_pages: int, every_pages: int) -> list[int]:
    """The `l3_checkpoint_ends` whose window [max(0, end - window_pages), end) is whole in the sequence's SWA
    page table (`swa_table[j]` >= 0: page j holds SWA KV now; a retained window the cache took back is skipped)."""
    return [e for e in l3_checkpoint_ends(pages, every_pages)
            if len(swa_table) >= e and all(s >= 0 for s in swa_table[max(0, e - window_pages):e])]


def l3_footprint(layout: KVLayout, page_size: int, window: int, blocks: int,
                 checkpoints: Sequence[int]) -> tuple[int, int]:
    """(bytes L3 stores for `blocks` full values and the checkpoints ending at the blocks `checkpoints`, the
    dual-layout limit for the same cached tokens: full KV of every token plus one window of SWA KV per checkpoint
    (clamped to the tokens before it)). Their ratio is `l3_bytes_per_token_ratio`; it exceeds 1 only by the
    rounding of the window up to whole pages."""
    wp = -(-window // page_size)
    swa_token = layout.swa_layers * layout.swa_bytes_per_token_layer
    stored = blocks * layout.full_page_bytes(page_size) + sum(
        min(wp, b + 1) for b in checkpoints) * layout.swa_page_bytes(page_size)
    limit = blocks * page_size * layout.full_layers * layout.full_bytes_per_token_layer + sum(
        min(window, (b + 1) * page_size) for b in checkpoints) * swa_token
    return stored, limit
