"""The embedding cache: content hash -> the tower's rows, LRU within a byte budget, with leases (pure: no IO).

A lease keeps an entry at least `lease_s` from its last encode or hit, whatever the budget says: the gateway
encodes, then the prefill fetches, maybe seconds later behind a queue, and must find the rows. Eviction
therefore walks from the least recently used end and skips leased entries. When the leased entries alone
leave no room for a new one, `put` refuses it (the caller answers "unavailable": the client may go to another
encoder, or retry later) instead of growing without bound.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Entry:
    rows: torch.Tensor
    """``[num_tokens, hidden]``, contiguous, on the host (the transfer engine sends from it)."""
    grid: tuple[int, int, int]
    lease_until: float

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()


class CacheFull(Exception):
    """No room for an entry: leased entries hold the budget (or the entry is larger than the whole budget)."""


class EmbeddingCache:
    def __init__(self, budget_bytes: int, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget_bytes = budget_bytes
        self.lease_s = lease_s
        self._clock = clock
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.used_bytes = 0
        self.evictions = 0
        self.refusals = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._entries

    def get(self, mm_hash: int) -> Entry | None:
        """The entry (now most recently used, its lease renewed), or None."""
        entry = self._entries.get(mm_hash)
        if entry is not None:
            self._entries.move_to_end(mm_hash)
            entry.lease_until = max(entry.lease_until, self._clock() + self.lease_s)
        return entry

    def put(self, mm_hash: int, rows: torch.Tensor, grid: tuple[int, int, int]) -> Entry:
        """Store (or refresh) an entry under a fresh lease, evicting unleased LRU entries to make room; raises
        CacheFull (nothing changed) when there is none."""
        old = self._entries.get(mm_hash)
        if old is not None:
            return self.get(mm_hash) or old
        entry = Entry(rows, grid, self._clock() + self.lease_s)
        victims = self._victims(entry.nbytes)
        if victims is None:
            self.refusals += 1
            raise CacheFull(f"embedding cache full: {self.used_bytes} of {self.budget_bytes} bytes leased, "
                            f"{entry.nbytes} more needed")
        for key in victims:
            self.used_bytes -= self._entries.pop(key).nbytes
            self.evictions += 1
        self._entries[mm_hash] = entry
        self.used_bytes += entry.nbytes
        return entry

    def _victims(self, need: int) -> list[int] | None:
        """Unleased keys, least recently used first, whose eviction frees `need` bytes; None when not enough."""
        free = self.budget_bytes - self.used_bytes
        if free >= need:
            return []
        now = self._clock()
        out = []
        for key, entry in self._entries.items():
            if entry.lease_until <= now:
                out.append(key)
                free += entry.nbytes
                if free >= need:
                    return out
        return None

    def leased_bytes(self) -> int:
        now = self._clock()
        return sum(e.nbytes for e in self._entries.values() if e.lease_until > now)
