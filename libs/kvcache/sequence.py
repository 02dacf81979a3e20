"""The per-sequence view: one logical token sequence over both pools.

`full[j]` is the full-pool page of logical page j (authoritative); `swa[j]` its SWA page, or -1 where no
SWA KV is held. Pages j < hit_pages belong to the prefix tree, locked by this sequence; the rest are its own
until `finish` hands them to the tree or frees them. After a rebuild hit, SWA KV below `scratch_end` is
inexact scratch, never retained or inserted. `lazy` pages are checkpoints the cache may take back at any
time, so they never add to what the sequence is promised. Details: docs/kvcache.md, "Parts".
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from libs.kvcache.tree import Node


@dataclass(slots=True)
class SeqAllocation:
    seq_id: str
    tokens: list[int]
    hit_tokens: int
    hit_pages: int
    lock_node: Node | None  # deepest node of the hit (None: no hit)
    full_cap: int  # private full pages promised at admission
    swa_cap: int  # private SWA pages promised at admission (window + page + checkpoints)
    keep: frozenset[int]  # private page indices whose SWA pages are retained (checkpoints)
    keep_all: bool
    # int64 arrays, not lists: slicing them into tree nodes is a memcpy, and they are invisible to the GC
    full: array = field(default_factory=lambda: array("q"))
    swa: array = field(default_factory=lambda: array("q"))
    num_computed: int = 0
    reserved_upto: int = 0  # tokens whose pages are allocated
    swa_private: int = 0
    swa_lo: int = 0  # every private SWA page below this index is freed, except kept ones
    swa_locked: bool = False  # still reading the hit's SWA pages (tree-owned)
    ckpt_ends: tuple[int, ...] = ()  # page indices where checkpoints end (new tree nodes are cut there)
    ckpt_kinds: dict[int, int] = field(default_factory=dict)  # checkpoint end page -> CheckpointKind bits
    keep_kinds: dict[int, int] = field(default_factory=dict)  # kept page -> bits of the checkpoints it serves
    hashes: Sequence[int] = ()  # the prompt's block hashes (a slice of what the caller gave, or the hit path's)
    # Kept pages of cold checkpoints that left the window: still in `swa`, but evictable cache, not the
    # sequence's usage (reclaimed in SWA-LRU order with the tree's cold checkpoints; see KVCache._slide_window).
    lazy: set[int] = field(default_factory=set)
    lazy_taken: bool = False  # the cache took back a lazy page (its window may be partial now)
    swa_from: int = 0  # first logical page whose SWA pages the sequence owns (hit_pages, or R / page: rebuild)
    scratch_end: int = 0  # rebuild: SWA pages below this are scratch (never kept); else swa_from

    @property
    def full_private(self) -> int:
        return len(self.full) - self.hit_pages

    def full_outstanding(self) -> int:
        return max(0, self.full_cap - self.full_private)

    def swa_outstanding(self) -> int:
        return max(0, self.swa_cap - self.swa_private)
