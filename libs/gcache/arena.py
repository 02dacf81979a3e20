"""`SegmentArena`: reusable (and optionally pre-faulted) memory for GCache value buffers.

A node's put slots and a client's get landing buffers come from one anonymous mapping carved into
fixed-size segments, so a transfer lands in memory that is already faulted. `alloc(size)` bump-allocates
in the open segment and returns None for a value larger than a segment or when no segment is free (then
`Allocator` allocates on its own). A segment is reused only when no reference to any of its buffers is
left (a `weakref.finalize` per buffer). `prefault()` populates the mapping's page tables on a daemon thread
without writing data. Thread-safe. Memory: `capacity` bytes of address space, resident as touched; one
live value pins its whole segment. Rationale: docs/gcache.md, "Value memory".
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import weakref
from collections import deque
from collections.abc import Callable

import numpy as np

log = logging.getLogger("windserve.gcache")

MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_PREFAULT_STEP = 64 << 20  # bytes per madvise call (the thread yields between steps)


class SegmentArena:
    def __init__(self, capacity: int, segment_bytes: int = 64 << 20, huge_pages: bool = True) -> None:
        if segment_bytes <= 0 or capacity < segment_bytes:
            raise ValueError(f"SegmentArena needs capacity >= segment_bytes > 0, got {capacity}, {segment_bytes}")
        self.segment_bytes = segment_bytes
        self.segments = capacity // segment_bytes
        self.capacity = self.segments * segment_bytes
        self._map = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge_pages = huge_pages and _madvise_huge(self._map)
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(self.segments))
        self._live = [0] * self.segments  # buffers alive per segment
        self._open = -1  # the segment being bump-allocated (-1: none)
        self._top = 0  # its next free offset
        self.allocated = 0  # buffers handed out (counters for tests and health)
        self.fallbacks = 0  # alloc calls answered None
        self.prefaulted = 0  # bytes whose page tables prefault() populated

    # ------------------------------------------------------------------ allocation

    def alloc(self, size: int) -> memoryview | None:
        """A writable `size`-byte buffer from the arena, or None (larger than a segment, or no room)."""
        if size <= 0 or size > self.segment_bytes:
            self.fallbacks += size > 0
            return None
        with self._lock:
            if self._open >= 0 and self._live[self._open] == 0:
                self._top = 0  # every buffer of the open segment is gone: start it again (its pages are faulted)
            if self._open < 0 or self._top + size > self.segment_bytes:
                if not self._next_segment():
                    self.fallbacks += 1
                    return None
            seg, start = self._open, self._open * self.segment_bytes + self._top
            self._top += size
            self._live[seg] += 1
            self.allocated += 1
        part = self._array[start:start + size]
        weakref.finalize(part, self._release, seg)
        return memoryview(part)  # type: ignore[arg-type]  # (numpy arrays export the buffer protocol)

    def _next_segment(self) -> bool:
        """Close the open segment (it returns to the free list once its buffers are gone) and open a free one."""
        old = self._open
        self._open = -1
        if old >= 0 and self._live[old] == 0:
            self._free.appendleft(old)  # (touched already: reused before never-touched ones)
        if not self._free:
            return False
        self._open, self._top = self._free.popleft(), 0
        return True

    def _release(self, seg: int) -> None:
        with self._lock:
            self._live[seg] -= 1
            if self._live[seg] == 0 and seg != self._open:
                self._free.appendleft(seg)  # (faulted already: reused before never-touched ones)

    def free_segments(self) -> int:
        with self._lock:
            return len(self._free) + (self._open >= 0 and self._live[self._open] == 0)

    # ------------------------------------------------------------------ prefault

    def prefault(self, on_done: Callable[[], object] | None = None) -> threading.Thread:
        """Populate the mapping's page tables in a daemon thread (no data written; ctypes releases the GIL
        during each madvise). Where the kernel refuses (older than 5.14), pages just fault on first use."""
        def run() -> None:
            libc = ctypes.CDLL(None, use_errno=True)
            base = self._array.ctypes.data
            for off in range(0, self.capacity, _PREFAULT_STEP):
                n = min(_PREFAULT_STEP, self.capacity - off)
                if libc.madvise(ctypes.c_void_p(base + off), ctypes.c_size_t(n), MADV_POPULATE_WRITE) != 0:
                    log.info("gcache arena: prefault refused (errno %d); pages fault on first use",
                             ctypes.get_errno())
                    break
                self.prefaulted += n
            if on_done is not None:
                on_done()

        thread = threading.Thread(target=run, name="gcache-prefault", daemon=True)
        thread.start()
        return thread


def _madvise_huge(m: mmap.mmap) -> bool:
    """Ask for transparent huge pages on the mapping (THP "madvise" mode: only madvised memory gets them, as
    numpy does for its own large arrays). False where the kernel or Python cannot."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        m.madvise(advice)
    except OSError:
        return False
    return True


class Allocator:
    """`alloc(size)`: from the arena when it has room, else a fresh numpy buffer (faults on first touch) —
    never fails for want of arena space. Without an arena (capacity 0), always fresh buffers."""

    def __init__(self, arena: SegmentArena | None) -> None:
        self.arena = arena

    def __call__(self, size: int) -> memoryview:
        if self.arena is not None:
            buf = self.arena.alloc(size)
            if buf is not None:
                return buf
        return memoryview(np.empty(size, dtype=np.uint8))  # type: ignore[arg-type]
