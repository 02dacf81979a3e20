"""libs/gcache/arena.py: segment reuse only after every buffer of a segment is gone, fallbacks, prefault."""

from __future__ import annotations

import gc

import pytest
import torch

from libs.gcache.arena import Allocator, SegmentArena

pytestmark = pytest.mark.unit
KIB = 1 << 10


def test_a_segment_is_reused_only_when_nothing_references_its_buffers() -> None:
    arena = SegmentArena(4 * 64 * KIB, 64 * KIB)
    a, b = arena.alloc(40 * KIB), arena.alloc(20 * KIB)  # both in segment 0
    c = arena.alloc(30 * KIB)  # does not fit segment 0's rest: segment 1
    assert a is not None and b is not None and c is not None and arena.free_segments() == 2
    a[:] = b"\x01" * len(a)
    t = torch.frombuffer(b, dtype=torch.uint8)  # a tensor over b keeps it alive after b's memoryview goes
    del a, b
    gc.collect()
    assert arena.free_segments() == 2  # segment 0 still has b (through t)
    del t
    gc.collect()
    assert arena.free_segments() == 3  # segment 0 is free again (segment 1 is open, holding c)
    held = [arena.alloc(64 * KIB) for _ in range(4)]  # segments 0, 2, 3 (1 still holds c), then none
    assert [h is not None for h in held] == [True, True, True, False]
    assert arena.alloc(65 * KIB) is None and arena.fallbacks == 2  # larger than a segment


def test_the_allocator_falls_back_to_fresh_buffers_and_prefault_writes_nothing() -> None:
    arena = SegmentArena(2 * 64 * KIB, 64 * KIB)
    alloc = Allocator(arena)
    held = [alloc(64 * KIB) for _ in range(3)]  # the third has no segment: a fresh buffer
    assert all(len(v) == 64 * KIB and not v.readonly for v in held) and arena.fallbacks == 1
    held[0][:] = b"\x07" * len(held[0])
    arena.prefault().join(30)
    assert bytes(held[0]) == b"\x07" * len(held[0])  # populating page tables kept the bytes in use
    assert len(Allocator(None)(5)) == 5 and len(alloc(0)) == 0


def _arena_store(segments: int, segment: int, evict_segments: int = 2):
    """A node store over an arena, wired as the cache service wires it."""
    from services.gcache.store import NodeStore

    arena = SegmentArena(segments * segment, segment)
    store = NodeStore(segments * segment, allocate=Allocator(None), arena=arena, arena_evict_segments=evict_segments)
    return arena, store


def _put(store, key: str, size: int, fill: int) -> None:
    from libs.gcache.keys import value_checksum

    data = bytes([fill]) * size
    slot = store.begin_put(key, len(data), value_checksum(data))
    assert slot is not None
    slot.buffer[:] = data
    assert store.commit(slot)


def test_store_values_in_the_arena_keep_their_segment_until_the_last_reader_lets_go() -> None:
    """A node store over the arena: an evicted value's segment is reused only after a get's view of it is
    gone (a send in flight keeps its bytes); meanwhile the next least recently used value makes room, and what
    the next put lands there is its own."""
    arena, store = _arena_store(2, 64 * KIB)
    _put(store, "k1", 64 * KIB, 1)
    _put(store, "k2", 64 * KIB, 2)
    reader = store.get("k1")  # (k1 is now the most recently used)
    _put(store, "k3", 64 * KIB, 3)  # evicts k2 first; nothing refers to it: k3 lands in its segment
    assert store.stats()["fresh_buffers"] == 0 and arena.free_segments() == 0
    _put(store, "k4", 64 * KIB, 4)  # evicts k1 for the budget, still read: its segment stays pinned, so k3 goes
    gc.collect()                   # too and k4 lands in k3's segment
    assert store.stats()["fresh_buffers"] == 0 and not store.exists("k3") and bytes(reader) == b"\x01" * (64 * KIB)
    assert store.stats()["evictions"] == 3
    del reader
    gc.collect()
    assert arena.free_segments() == 1
    _put(store, "k5", 64 * KIB, 5)  # room in the budget and k1's segment free again
    assert store.stats()["fresh_buffers"] == 0
    assert [bytes(store.get(k) or b"")[:1] for k in ("k4", "k5")] == [b"\x04", b"\x05"]
    store.check_invariants()


def test_a_put_into_a_fragmented_arena_evicts_the_least_recently_used_instead_of_faulting_fresh_memory() -> None:
    """Values that leave a segment's rest unused fill the arena before the budget: the next put finds room in
    the budget but no free segment, and evicts the oldest value (bounded by arena_evict_segments) rather than
    take a fresh buffer. With no eviction allowed it takes a fresh one."""
    seg = 64 * KIB
    for evict, fresh, kept in ((2, 0, ["b", "c", "d", "e"]), (0, 1, ["a", "b", "c", "d", "e"])):
        arena, store = _arena_store(4, seg, evict)
        for i, key in enumerate("abcd"):
            _put(store, key, seg * 6 // 10, i)  # one per segment (0.6 of one: the next does not fit its rest)
        assert arena.free_segments() == 0 and store.usage().memory_used < 4 * seg - seg
        _put(store, "e", seg, 9)
        gc.collect()
        assert store.stats()["fresh_buffers"] == fresh, evict
        assert [k for k in "abcde" if store.exists(k)] == kept
        assert bytes(store.get("e") or b"") == b"\x09" * seg
        store.check_invariants()
    # a value the arena never holds (0 bytes, larger than a segment) evicts nothing to make arena room
    arena, store = _arena_store(4, seg)
    for i, key in enumerate("abcd"):
        _put(store, key, seg * 6 // 10, i)
    _put(store, "empty", 0, 0)
    _put(store, "big", seg + 1, 7)
    assert store.stats()["evictions"] == 0 and store.stats()["fresh_buffers"] == 0
    assert all(store.exists(k) for k in ("a", "b", "c", "d", "empty", "big"))
    store.check_invariants()


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["tcp", "ucx"])
async def test_a_finished_transfer_lets_go_of_its_landing_buffers(backend: str) -> None:
    """A get's landing buffers go back to the arena as soon as the caller drops the values: nothing in the
    transfer engine keeps a completed transfer (the header deadline's timer used to, for header_timeout_s =
    60 s, so every get after the first few fell back to fresh memory and paid its page faults)."""
    from libs.gcache import wire
    from libs.transfer import TransferBackend, TransferConfig, create_engine

    if backend == "ucx":
        pytest.importorskip("ucxx")
    kind = TransferBackend(backend)
    rx, tx = create_engine(TransferConfig(), kind), create_engine(TransferConfig(), kind)
    addr = await rx.start()
    await tx.start()
    try:
        arena = SegmentArena(2 * 64 * KIB, 64 * KIB)
        alloc = Allocator(arena)
        for round_ in range(4):  # more rounds than segments: only reuse keeps the allocator in the arena
            data = bytes([round_ + 1]) * (64 * KIB)
            buf = alloc(len(data))
            incoming = rx.expect(f"get-{round_}", wire.chunk_views(buf, 16 * KIB))
            await tx.send(addr, f"get-{round_}", wire.layer_specs([len(data)], 16 * KIB),
                          wire.chunk_views(data, 16 * KIB))
            await incoming.wait(timeout=10)
            assert bytes(buf) == data
            del buf, incoming
            gc.collect()
            assert arena.free_segments() == 2, f"round {round_}: a finished transfer still holds its buffers"
        assert arena.fallbacks == 0
    finally:
        await tx.close()
        await rx.close()
