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


def test_store_values_in_the_arena_keep_their_segment_until_the_last_reader_lets_go() -> None:
    """A node store over the arena: an evicted value's segment is reused only after a get's view of it is
    gone (a send in flight keeps its bytes), and what the next put lands there is its own."""
    from libs.gcache.keys import value_checksum
    from services.cache.store import NodeStore

    arena = SegmentArena(2 * 64 * KIB, 64 * KIB)
    store = NodeStore(2 * 64 * KIB, allocate=Allocator(arena))

    def put(key: str, fill: int) -> None:
        data = bytes([fill]) * (64 * KIB)
        slot = store.begin_put(key, len(data), value_checksum(data))
        assert slot is not None
        slot.buffer[:] = data
        assert store.commit(slot)

    put("k1", 1)
    put("k2", 2)
    reader = store.get("k1")  # (k1 is now the most recently used)
    put("k3", 3)  # evicts k2 first; nothing refers to it: k3 lands in its segment
    assert arena.fallbacks == 0 and arena.free_segments() == 0
    put("k4", 4)  # evicts k1, still read: its segment stays pinned, k4 gets a fresh buffer
    gc.collect()
    assert arena.fallbacks == 1 and arena.free_segments() == 0 and bytes(reader) == b"\x01" * (64 * KIB)
    del reader
    gc.collect()
    assert arena.free_segments() == 1
    put("k5", 5)  # evicts k3; k5 takes k1's segment
    assert arena.fallbacks == 1
    assert [bytes(store.get(k) or b"")[:1] for k in ("k4", "k5")] == [b"\x04", b"\x05"]
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
