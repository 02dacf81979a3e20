"""GCache (L3) bookkeeping that needs no IO: which hit an L3 lookup takes, and what L3 stores per cached token.

Values (docs/kvcache.md, "Engine integration (L3)"): per page-aligned block b a *full value* (the block's page of
every full-attention layer, K and V) and, at the blocks where a sequence ended, an *SWA checkpoint* (the SWA
layers' K and V of the window's pages ending at b: min(window pages, b + 1) pages). A hit ending at block m is
valid when the full values of every block up to m and the checkpoint at m exist.
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
