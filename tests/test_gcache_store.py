"""The storage node's tiers (services/gcache/store.py): atomic puts, LRU demotion / promotion / eviction under both
budgets, checksums on every read, reaping, and the disk tier's re-index on restart. Real files in tmp dirs."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.gcache.keys import value_checksum
from services.gcache.disk_tier import file_name
from services.gcache.store import NodeStore, PutSlot, PutState

pytestmark = pytest.mark.unit


def value(tag: int, size: int) -> bytes:
    return bytes((tag * 31 + i) % 251 for i in range(size))


def put(store: NodeStore, key: str, data: bytes) -> PutSlot | None:
    """begin_put + write + commit; the committed slot (None if refused or dropped)."""
    slot = store.begin_put(key, len(data), value_checksum(data))
    if slot is None:
        return None
    slot.buffer[:] = data
    return slot if store.commit(slot) else None


def on_disk(d: Path, key: str) -> bool:
    return (d / file_name(key)).is_file()


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- the atomic-put state machine ------------------------------------------------------------------------------


def test_value_visible_only_after_commit_and_immutable() -> None:
    s = NodeStore(1000)
    data = value(1, 100)
    slot = s.begin_put("k", 100, value_checksum(data))
    assert slot is not None and slot.state is PutState.WRITING
    slot.buffer[:] = data
    assert not s.exists("k") and s.get("k") is None  # written but not committed: invisible
    assert s.begin_put("k", 100, value_checksum(data)) is None  # in flight: refused
    assert s.commit(slot) and slot.state is PutState.COMMITTED
    assert s.exists("k") and bytes(s.get("k") or b"") == data
    assert s.begin_put("k", 100, value_checksum(data)) is None  # committed: immutable
    assert not s.commit(slot)  # a slot commits once
    st_ = s.stats()
    assert (st_["committed"], st_["rejected"], st_["hits"], st_["misses"]) == (1, 2, 1, 1)
    view = s.get("k")
    assert view is not None and view.readonly
    s.check_invariants()


def test_bad_checksum_at_commit_is_dropped_and_returns_the_reservation() -> None:
    s = NodeStore(100)
    data = value(2, 100)
    slot = s.begin_put("k", 100, value_checksum(data) ^ 1)
    assert slot is not None
    slot.buffer[:] = data
    assert not s.commit(slot) and slot.state is PutState.DROPPED
    assert not s.exists("k") and s.stats()["checksum_failures"] == 1
    assert put(s, "k", data) is not None  # the key is absent again and the whole budget is free
    s.check_invariants()


def test_abort_and_reservations() -> None:
    s = NodeStore(100)
    a = s.begin_put("a", 60, 0)
    assert a is not None
    assert s.begin_put("b", 60, 0) is None  # 60 of 100 reserved: no room, and reservations cannot be demoted
    assert s.begin_put("big", 101, 0) is None  # larger than the memory budget: refused
    s.abort(a)
    assert a.state is PutState.ABORTED and not s.commit(a) and not s.exists("a")
    assert s.inflight() == 0 and s.usage().memory_used == 0
    assert put(s, "b", value(3, 100)) is not None  # the reservation came back
    assert s.stats()["rejected"] == 2 and s.stats()["aborted"] == 1
    s.check_invariants()


def test_reservation_demotes_committed_values_so_commit_never_overflows(tmp_path: Path) -> None:
    s = NodeStore(200, 1000, tmp_path)
    assert put(s, "a", value(1, 100)) and put(s, "b", value(2, 100))
    slot = s.begin_put("c", 100, value_checksum(value(3, 100)))
    assert slot is not None
    assert on_disk(tmp_path, "a") and not on_disk(tmp_path, "b")  # the LRU value made room at begin_put
    slot.buffer[:] = value(3, 100)
    assert s.commit(slot)
    u = s.usage()
    assert (u.memory_used, u.disk_used, u.keys) == (200, 100, 3)
    s.check_invariants()


def test_reap_drops_stale_puts_with_a_fake_clock() -> None:
    clock = FakeClock()
    s = NodeStore(100, put_timeout_s=30.0, clock=clock)
    old = s.begin_put("old", 50, value_checksum(value(1, 50)))
    clock.now = 20.0
    young = s.begin_put("young", 50, value_checksum(value(2, 50)))
    assert old is not None and young is not None
    clock.now = 30.0
    assert s.reap() == 0  # not older than the timeout yet
    clock.now = 31.0
    assert s.reap() == 1 and old.state is PutState.REAPED
    old.buffer[:] = value(1, 50)
    assert not s.commit(old) and not s.exists("old")  # the client came back too late
    young.buffer[:] = value(2, 50)
    assert s.commit(young)
    assert put(s, "old", value(1, 50)) is not None  # its reservation and key are free again
    assert s.stats()["reaped"] == 1
    s.check_invariants()


# -- tiers: LRU demotion, promotion, eviction --------------------------------------------------------------------


def test_lru_demotion_and_promotion(tmp_path: Path) -> None:
    s = NodeStore(300, 1000, tmp_path)
    for i, k in enumerate("abc"):
        assert put(s, k, value(i, 100))
    assert s.get("a") is not None  # LRU order now b, c, a
    assert put(s, "d", value(3, 100))
    assert on_disk(tmp_path, "b") and not any(on_disk(tmp_path, k) for k in "acd")
    assert s.usage().disk_used == 100 and s.exists("b")
    assert bytes(s.get("b") or b"") == value(1, 100)  # read from disk, promoted; c (LRU) demoted for it
    assert not on_disk(tmp_path, "b") and on_disk(tmp_path, "c")
    st_ = s.stats()
    assert (st_["demotions"], st_["promotions"], st_["evictions"]) == (2, 1, 0)
    u = s.usage()
    assert (u.memory_used, u.disk_used, u.keys) == (300, 100, 4)
    s.check_invariants()


def test_disk_value_too_big_for_memory_now_is_served_from_disk(tmp_path: Path) -> None:
    s = NodeStore(200, 1000, tmp_path)
    assert put(s, "a", value(1, 150)) and put(s, "b", value(2, 150))  # a demoted
    inflight = s.begin_put("c", 100, 0)  # 100 reserved: a (150) cannot come back to memory now
    assert inflight is not None
    assert bytes(s.get("a") or b"") == value(1, 150)
    assert on_disk(tmp_path, "a") and s.stats()["promotions"] == 0
    s.check_invariants()


def test_eviction_without_a_disk_tier() -> None:
    s = NodeStore(300)
    for i, k in enumerate("abcd"):
        assert put(s, k, value(i, 100))
    assert not s.exists("a") and s.get("a") is None
    assert all(s.exists(k) for k in "bcd") and s.stats()["evictions"] == 1
    s.check_invariants()


def test_eviction_under_the_disk_budget(tmp_path: Path) -> None:
    s = NodeStore(100, 200, tmp_path)
    for i, k in enumerate("abcd"):
        assert put(s, k, value(i, 100))  # a, b, c demoted in turn; c's demotion evicts a from disk
    assert not s.exists("a") and not on_disk(tmp_path, "a")
    assert all(s.exists(k) for k in "bcd")
    assert put(s, "e", value(9, 100)) and not s.exists("b")  # and again: b, the disk's LRU
    u = s.usage()
    assert (u.memory_used, u.disk_used, u.keys) == (100, 200, 3)
    assert s.stats()["evictions"] == 2 and s.stats()["demotions"] == 4
    s.check_invariants()


def test_value_larger_than_the_disk_budget_is_evicted_not_demoted(tmp_path: Path) -> None:
    s = NodeStore(300, 200, tmp_path)
    assert put(s, "big", value(1, 250)) and put(s, "x", value(2, 100))
    assert not s.exists("big") and s.stats()["evictions"] == 1 and s.usage().disk_used == 0


# -- checksums: a bad value is a miss, never wrong bytes ----------------------------------------------------------


def test_flipped_byte_in_memory_is_a_miss() -> None:
    s = NodeStore(1000)
    slot = put(s, "k", value(1, 100))
    assert slot is not None
    slot.buffer[7] ^= 0xFF  # the store owns this buffer after commit: a scribble on it is memory corruption
    assert s.get("k") is None and not s.exists("k")
    assert s.stats()["checksum_failures"] == 1 and s.stats()["misses"] == 1
    s.check_invariants()


def _demote_to_disk(s: NodeStore, d: Path, key: str, data: bytes) -> None:
    assert put(s, key, data)
    assert put(s, key + "-pusher", value(99, s.memory_bytes))  # fills memory: key goes to disk
    assert on_disk(d, key)


@pytest.mark.parametrize("where", ["value", "header"])
def test_flipped_byte_on_disk_is_a_miss(tmp_path: Path, where: str) -> None:
    s = NodeStore(100, 1000, tmp_path)
    _demote_to_disk(s, tmp_path, "k", value(1, 100))
    path = tmp_path / file_name("k")
    raw = bytearray(path.read_bytes())
    raw[-5 if where == "value" else 10] ^= 0x01
    path.write_bytes(raw)
    assert s.exists("k")  # exists does not read the value ...
    assert s.get("k") is None  # ... get does, and drops it
    assert not s.exists("k") and not path.exists()
    assert s.stats()["checksum_failures"] == 1 and s.stats()["hits"] == 0
    s.check_invariants()


def test_a_file_swapped_for_another_keys_file_is_a_miss(tmp_path: Path) -> None:
    s = NodeStore(100, 1000, tmp_path)
    _demote_to_disk(s, tmp_path, "a", value(1, 100))
    _demote_to_disk(s, tmp_path, "b", value(2, 100))
    (tmp_path / file_name("b")).replace(tmp_path / file_name("a"))
    assert s.get("a") is None and s.get("b") is None  # b's bytes are never served as a's
    assert s.stats()["checksum_failures"] == 2 and s.usage().disk_used == 100  # a-pusher's, still good
    s.check_invariants()


def test_a_failed_demotion_write_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = NodeStore(100, 1000, tmp_path)
    assert put(s, "a", value(1, 100))

    def no_space(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    assert put(s, "b", value(2, 100))  # a's demotion fails: a is evicted instead
    assert not s.exists("a") and list(tmp_path.iterdir()) == []
    assert s.stats()["evictions"] == 1 and s.stats()["demotions"] == 0 and s.usage().disk_used == 0
    s.check_invariants()


# -- the disk tier across a restart ------------------------------------------------------------------------------


def test_restart_reindexes_and_drops_broken_files(tmp_path: Path) -> None:
    s = NodeStore(100, 10_000, tmp_path)
    for i in range(4):
        _demote_to_disk(s, tmp_path, f"k{i}", value(i, 100))
    s.close()
    truncated = tmp_path / file_name("k3")
    truncated.write_bytes(truncated.read_bytes()[:-1])
    (tmp_path / (file_name("k9") + ".tmp")).write_bytes(b"half a value")  # a crash mid-demotion
    (tmp_path / file_name("garbage")).write_bytes(os.urandom(200))  # a valid name, a corrupt header
    (tmp_path / "notes.txt").write_bytes(b"not ours either")
    (tmp_path / file_name("elsewhere")).write_bytes((tmp_path / file_name("k0")).read_bytes())  # a wrong name
    s2 = NodeStore(100, 10_000, tmp_path)
    survivors = ["k0", "k1", "k2", "k0-pusher", "k1-pusher", "k2-pusher"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(file_name(k) for k in survivors)
    assert s2.stats()["removed_files"] == 5 and s2.usage().disk_used == 600
    assert [k for k in survivors if s2.exists(k)] == survivors
    assert not s2.exists("k3") and not s2.exists("k3-pusher")  # truncated; only ever in memory
    assert not s2.exists("elsewhere")
    for i in range(3):
        assert bytes(s2.get(f"k{i}") or b"") == value(i, 100)
    s2.check_invariants()


def test_restart_with_a_smaller_disk_budget_evicts_the_oldest(tmp_path: Path) -> None:
    s = NodeStore(100, 10_000, tmp_path)
    keys = [f"k{i}" for i in range(5)]
    for i, k in enumerate(keys):
        assert put(s, k, value(i, 100))
    assert put(s, "last", value(9, 100))  # k0..k4 on disk
    s.close()
    for i, k in enumerate(keys):  # LRU order on restart is the files' mtime: k3 the oldest, then k1, ...
        t = 1_000_000 + [3, 1, 4, 0, 2].index(i)
        os.utime(tmp_path / file_name(k), (t, t))
    s2 = NodeStore(100, 300, tmp_path)
    assert [k for k in keys if s2.exists(k)] == ["k0", "k2", "k4"]
    assert s2.usage().disk_used == 300 and s2.stats()["evictions"] == 2
    assert not on_disk(tmp_path, "k3") and not on_disk(tmp_path, "k1")
    s2.check_invariants()


def test_without_a_disk_budget_the_directory_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "foreign.tmp").write_bytes(b"x")
    s = NodeStore(100, 0, tmp_path)
    assert put(s, "a", value(1, 100)) and put(s, "b", value(2, 100))
    assert not s.exists("a") and [p.name for p in tmp_path.iterdir()] == ["foreign.tmp"]


# -- property: random operation sequences against a model ---------------------------------------------------------

KEYS = [f"k{i}" for i in range(6)]
SIZES = [0, 10, 40, 100, 180]
MEMORY, TIMEOUT = 256, 25.0
OPS = st.lists(st.tuples(st.sampled_from(["begin"] * 3 + ["commit"] * 3 + ["get"] * 2 + [
                                          "bad_commit", "abort", "tick_reap", "flip", "restart"]),
                         st.sampled_from(KEYS), st.sampled_from(SIZES)), min_size=20, max_size=60)


class Model:
    """What the store must agree with: the bytes each key was committed with, the slots in flight."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.slots: dict[str, PutSlot] = {}
        self.buffers: dict[str, bytearray] = {}  # committed slots' buffers (to scribble on)
        self.flipped: set[str] = set()
        self.serial = 0

    def reserved(self) -> int:
        return sum(s.size for s in self.slots.values())

    def take_slot(self, key: str) -> PutSlot | None:
        """One of the slots in flight (chosen by `key`'s index, so most draws hit one)."""
        if not self.slots:
            return None
        return self.slots.pop(sorted(self.slots)[KEYS.index(key) % len(self.slots)])


class Run:
    def __init__(self, disk: int, d: str) -> None:
        self.disk, self.dir, self.clock, self.m = disk, Path(d), FakeClock(), Model()
        self.s = self._open()

    def _open(self) -> NodeStore:
        return NodeStore(MEMORY, self.disk, self.dir, put_timeout_s=TIMEOUT, clock=self.clock)

    def visible(self) -> set[str]:
        return {k for k in KEYS if self.s.exists(k)}

    def step(self, op: str, key: str, size: int) -> None:
        s, m = self.s, self.m
        before, usage = self.visible(), s.usage()
        on_disk_before = {k for k in before if on_disk(self.dir, k)}
        getattr(self, "op_" + op)(key, size)
        lost = before - self.visible()
        if op == "get" and key in m.flipped:
            lost.discard(key)  # a scribbled value found bad by the read
        if lost and op in ("begin", "get"):
            # a committed value leaves only for room: memory was short, and then the disk (if any) too
            need = size if op == "begin" else len(m.values[key])
            assert usage.memory_used + m.reserved() + need > MEMORY, f"{op} lost {lost} without pressure"
            assert not self.disk or usage.disk_used + usage.memory_used > self.disk or any(
                len(m.values[k]) > self.disk for k in lost), f"{op} lost {lost} with room on disk"
        elif op == "restart":
            assert on_disk_before <= self.visible(), "a disk value did not survive the restart"
        else:
            assert not lost, f"{op} lost {lost}"
        self.s.check_invariants()
        assert self.s.usage().disk_used <= self.disk and self.s.inflight() == len(m.slots)

    def op_begin(self, key: str, size: int) -> None:
        m = self.m
        expect = key not in m.slots and not self.s.exists(key) and size <= MEMORY - m.reserved()
        m.serial += 1
        data = value(m.serial, size)
        slot = self.s.begin_put(key, size, value_checksum(data))
        assert (slot is not None) == expect
        if slot is not None:
            slot.buffer[:] = data
            m.slots[key] = slot
            assert not self.s.exists(key) and self.s.get(key) is None  # invisible while in flight

    def op_commit(self, key: str, size: int) -> None:
        slot = self.m.take_slot(key)
        if slot is None:
            return
        key = slot.key
        assert self.s.commit(slot) and self.s.exists(key)
        self.m.values[key] = bytes(slot.buffer)
        self.m.buffers[key] = slot.buffer
        self.m.flipped.discard(key)
        assert self.s.get(key) == self.m.values[key]

    def op_bad_commit(self, key: str, size: int) -> None:
        slot = self.m.take_slot(key)
        if slot is None:
            return
        slot.checksum ^= 1
        assert not self.s.commit(slot) and not self.s.exists(slot.key)

    def op_abort(self, key: str, size: int) -> None:
        slot = self.m.take_slot(key)
        if slot is not None:
            self.s.abort(slot)
            assert not self.s.exists(slot.key)

    def op_tick_reap(self, key: str, size: int) -> None:
        self.clock.now += 20.0  # one tick is within the timeout, two are past it
        stale = [k for k, sl in self.m.slots.items() if self.clock.now - sl.started_at > TIMEOUT]
        assert self.s.reap() == len(stale)
        for k in stale:
            slot = self.m.slots.pop(k)
            assert not self.s.commit(slot) and not self.s.exists(k)

    def op_get(self, key: str, size: int) -> None:
        existed = self.s.exists(key)
        got = self.s.get(key)
        if got is not None:
            assert key in self.m.values and got == self.m.values[key], "wrong bytes"
        elif existed:
            assert key in self.m.flipped, "an intact committed value was a miss"

    def op_flip(self, key: str, size: int) -> None:
        buf = self.m.buffers.get(key)
        if buf and self.s.exists(key):
            buf[0] ^= 0xFF  # corrupts the value if it still lives in this buffer (memory), else nothing
            self.m.flipped.add(key)

    def op_restart(self, key: str, size: int) -> None:
        self.s.close()
        assert all(sl.state is PutState.ABORTED for sl in self.m.slots.values())
        self.m.slots.clear()
        self.s = self._open()
        assert self.s.usage().memory_used == 0

    def finish(self) -> None:
        """Every reservation comes back: abort what is in flight, then the whole memory budget is free."""
        for slot in list(self.m.slots.values()):
            self.s.abort(slot)
        self.m.slots.clear()
        assert self.s.inflight() == 0
        assert put(self.s, "fresh", value(0, MEMORY)) is not None
        for k in KEYS:
            got = self.s.get(k)
            assert got is None or got == self.m.values[k]
        self.s.check_invariants()


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(disk=st.sampled_from([0, 300, 1000]), ops=OPS)
def test_random_operations_against_the_model(disk: int, ops: list[tuple[str, str, int]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        run = Run(disk, d)
        for op, key, size in ops:
            run.step(op, key, size)
        run.finish()
        run.s.close()


# ---------------------------------------------------------------------------------------------- the get handler


@pytest.mark.integration
async def test_a_get_hashes_memory_values_in_flight_and_never_completes_with_a_bad_one() -> None:
    """The node's get sends a memory value while hashing it: good values arrive byte-equal; a value corrupted in
    memory fails the client's transfer (its batch misses), is dropped and counted, and a later get misses it."""
    import asyncio

    from libs.gcache import wire
    from libs.transfer import TransferBackend, TransferConfig, TransferError, create_engine
    from protos.messages import CacheGetRequest
    from services.gcache.config import CacheConfig
    from services.gcache.handlers import CacheNode

    chunk = 64 << 10
    store = NodeStore(1 << 22)
    good, bad = value(1, 5 * chunk + 123), value(2, 3 * chunk)
    for key, data in (("good", good), ("bad", bad), ("empty", b"")):
        assert put(store, key, data) is not None
    node_engine = create_engine(TransferConfig(), TransferBackend.TCP)
    client = create_engine(TransferConfig(), TransferBackend.TCP)
    tasks: set[asyncio.Task] = set()
    node = CacheNode(CacheConfig(), store, node_engine, await node_engine.start(),
                     lambda coro, name: tasks.add(asyncio.ensure_future(coro)))
    addr = await client.start()

    async def get(tid: str, keys: list[str]) -> tuple[list[int], dict[int, bytearray]]:
        bufs: dict[int, bytearray] = {}

        def allocate(header):  # one buffer per value, from the header (as the SDK's landing)
            sizes = wire.value_sizes(header.layers)
            bufs.update({pos: bytearray(n) for pos, n in sizes.items()})
            return [v for pos in sorted(bufs) for v in wire.chunk_views(bufs[pos], chunk)]

        incoming = client.expect(tid, allocate)
        reply = await node.get(CacheGetRequest(transfer_id=tid, keys=keys, address=addr, chunk_bytes=chunk))
        await incoming.wait(timeout=10)
        return reply.sizes, bufs

    try:
        sizes, bufs = await get("t1", ["good", "absent", "empty", "bad"])
        assert sizes == [len(good), -1, 0, len(bad)] and bytes(bufs[0]) == good and bytes(bufs[3]) == bad
        stored = store._memory.peek("bad")  # scribble one byte of the stored value
        assert stored is not None
        stored.data[len(bad) // 2] ^= 0xFF
        with pytest.raises(TransferError):  # the client's transfer never completes: nothing is handed out
            await get("t2", ["good", "bad"])
        await asyncio.wait(tasks, timeout=10)
        assert store.stats()["checksum_failures"] == 1 and not store.exists("bad") and store.exists("good")
        sizes, bufs = await get("t3", ["bad", "good"])
        assert sizes == [-1, len(good)] and bytes(bufs[1]) == good
        store.check_invariants()
    finally:
        await client.close()
        await node_engine.close()
