"""Which logical KV pages a prefill ships to a decode worker, and in which segments (pure: no torch, no IO).

For an `n`-token prompt (page size `P`, window `W`, a page-aligned hit of `H` tokens on decode),
`plan_shipment` sends full pages [H/P, ceil(n/P)) and SWA pages [max(H/P, n//P - ceil(W/P)), ceil(n/P)):
exactly what the decode cache keeps live once the prompt is committed. `plan_stream` cuts this into
segments of `S` pages that can leave while prefill computes; the last one (the rest, with the SWA window)
is final only when the whole prompt is. Both sides derive the same plan from (n, P, W, H, S), so decode
checks the sender's header against its own. Protocol: docs/serving.md, "KV hand-off protocol".
"""

from __future__ import annotations

from dataclasses import dataclass


def _pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@dataclass(frozen=True)
class ShipPlan:
    """Logical pages of one prompt's KV that prefill sends to a decode worker holding [0, hit_tokens)."""

    num_tokens: int
    page_size: int
    window: int
    hit_tokens: int
    full_pages: tuple[int, ...]
    swa_pages: tuple[int, ...]

    @property
    def num_pages(self) -> int:
        return _pages(self.num_tokens, self.page_size)


def plan_shipment(num_tokens: int, page_size: int, window: int, hit_tokens: int = 0) -> ShipPlan:
    """Full-layer pages after the decode side's hit, SWA pages of the last window after it (see module doc)."""
    if num_tokens < 1 or page_size < 1 or window < 1:
        raise ValueError(f"plan_shipment: need num_tokens, page_size, window >= 1, got "
                         f"{num_tokens}, {page_size}, {window}")
    if hit_tokens % page_size or not 0 <= hit_tokens < num_tokens:
        raise ValueError(f"plan_shipment: hit of {hit_tokens} tokens must be page aligned and < {num_tokens}")
    n_pages = _pages(num_tokens, page_size)
    hit_pages = hit_tokens // page_size
    first_window_page = max(0, num_tokens // page_size - _pages(window, page_size))
    return ShipPlan(num_tokens, page_size, window, hit_tokens, tuple(range(hit_pages, n_pages)),
                    tuple(range(max(hit_pages, first_window_page), n_pages)))


def full_kv_pages(num_tokens: int, page_size: int) -> int:
    """Pages a naive transfer would move per layer (every layer holding the whole prompt)."""
    return _pages(num_tokens, page_size)


@dataclass(frozen=True)
class Segment:
    """Pages that travel together: final once `ready_tokens` prompt tokens are computed on prefill."""

    full_pages: tuple[int, ...]
    swa_pages: tuple[int, ...]
    ready_tokens: int


@dataclass(frozen=True)
class StreamPlan:
    """A ShipPlan cut into segments, in send order (see the module doc)."""

    ship: ShipPlan
    segment_pages: int
    segments: tuple[Segment, ...]


def plan_stream(num_tokens: int, page_size: int, window: int, hit_tokens: int = 0,
                segment_pages: int = 0) -> StreamPlan:
    """`plan_shipment`'s pages in segments of `segment_pages` full-layer pages; 0 = a single segment (the whole
    shipment once the prompt is computed). Concatenating the segments gives back the ShipPlan's pages."""
    if segment_pages < 0:
        raise ValueError(f"plan_stream: segment_pages must be >= 0, got {segment_pages}")
    ship = plan_shipment(num_tokens, page_size, window, hit_tokens)
    segments: list[Segment] = []
    start = hit_tokens // page_size
    if segment_pages:
        end = (start // segment_pages + 1) * segment_pages
        while end * page_size < num_tokens:  # complete before the prompt's end: can leave early
            segments.append(Segment(tuple(range(start, end)), (), end * page_size))
            start, end = end, end + segment_pages
    segments.append(Segment(tuple(range(start, ship.num_pages)), ship.swa_pages, num_tokens))
    return StreamPlan(ship, segment_pages, tuple(segments))
