"""The direct path of GCache (libs/gcache/direct.py, services/gcache/direct.py): puts and gets as MESSAGE frames
on the transfer engine's control connection plus one tagged UCX message per value (per slice of a larger one),
over real ucxx (UCX over tcp
on loopback). In-process: a node's handlers over a real `NodeStore` and a real UCX engine, a client's
`DirectCalls` on another engine. With node processes: `GCacheClient` against `python -m services.gcache`, the
direct path taken (the node's counters), and a client SIGKILLed halfway through a direct put."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from libs.gcache.arena import Allocator, SegmentArena
from libs.gcache.keys import value_checksum
from tests.fixtures.gcache import ROOT, UCX_ENV, CacheNodes, bounded

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
ucxx = pytest.importorskip("ucxx")
CHUNK = 64 << 10
HANG = 30.0


@pytest.fixture(autouse=True)
def _ucx_env(monkeypatch):
    for k, v in UCX_ENV.items():
        monkeypatch.setenv(k, v)


def data(tag: int, size: int) -> bytes:
    return bytes((i * 7 + tag) % 251 for i in range(size))


class Pair:
    """A node (store + CacheNode + DirectNode on a UCX engine) and a client (DirectCalls on another)."""

    async def start(self, put_timeout_s: float = 30.0, memory: int = 16 << 20) -> Pair:
        from libs.gcache.direct import DirectCalls
        from libs.transfer import TransferBackend, TransferConfig, create_engine
        from services.gcache.config import CacheConfig
        from services.gcache.direct import DirectNode
        from services.gcache.handlers import CacheNode
        from services.gcache.store import NodeStore

        self.tasks: set[asyncio.Task] = set()
        self.store = NodeStore(memory, put_timeout_s=put_timeout_s)
        self.node_engine = create_engine(TransferConfig(drain_timeout_s=1.0), TransferBackend.UCX)
        self.client_engine = create_engine(TransferConfig(drain_timeout_s=1.0), TransferBackend.UCX)
        self.address = await self.node_engine.start()
        await self.client_engine.start()
        spawn = lambda coro, name: self._spawn(coro)  # noqa: E731
        cfg = CacheConfig(put_timeout_s=put_timeout_s, send_timeout_s=5.0)
        self.node = CacheNode(cfg, self.store, self.node_engine, self.address, spawn)
        self.direct_node = DirectNode(self.node, self.node_engine, spawn)
        self.arena = SegmentArena(4 << 20, 1 << 20)
        self.calls = DirectCalls(self.client_engine, Allocator(self.arena), CHUNK, drain_timeout_s=1.0)
        return self

    def _spawn(self, coro):
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def deadline(self, s: float = 10.0) -> float:
        return asyncio.get_running_loop().time() + s

    async def put(self, items: list[tuple[str, bytes]]) -> list[bool]:
        return await self.calls.put(self.address, items, self.deadline())

    async def get(self, keys: list[str], timeout: float = 10.0):
        return await self.calls.get(self.address, keys, self.deadline(timeout))

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=5)
        await self.client_engine.close()
        await self.node_engine.close()


@pytest.fixture
async def pair():
    p = await Pair().start()
    try:
        yield p
    finally:
        await p.close()


async def test_direct_round_trip_byte_equal_with_zero_byte_odd_sized_and_refused_values(pair):
    big, odd, empty = data(1, 5 * CHUNK), data(2, 3 * CHUNK + 17), b""
    assert await pair.put([("big", big), ("odd", odd), ("empty", empty)]) == [True, True, True]
    pair.store.check_invariants()
    assert pair.store.inflight() == 0
    got = await pair.get(["odd", "absent", "empty", "big"])
    assert [None if g is None else bytes(g) for g in got] == [odd, None, b"", big]
    # a second put of a stored key is refused (keys are immutable), its bytes drained: the first value stays and
    # the connection keeps working (nothing left pending on either side)
    other = data(3, 2 * CHUNK)
    assert await pair.put([("big", data(9, 5 * CHUNK)), ("new", other)]) == [False, True]
    got = await pair.get(["big", "new"])
    assert bytes(got[0]) == big and bytes(got[1]) == other
    assert pair.node_engine.bytes_received == 0 and pair.client_engine.bytes_received == 0  # no transfer ran
    assert pair.direct_node.puts == 2 and pair.direct_node.gets == 2 and pair.calls.drops == 0


async def test_direct_put_stores_the_checksums_the_client_sent_after_its_values(pair):
    """The client hashes its values while they go and sends the sums after them; the node commits with those:
    the stored checksum is the value's own, for values of one message, several, a partial last one and none."""
    values = {"one": data(4, CHUNK), "many": data(5, 3 * CHUNK + 5), "tiny": b"x", "none": b""}
    assert await pair.put(list(values.items())) == [True] * 4
    for key, value in values.items():
        stored = pair.store._memory.peek(key)
        assert stored is not None and stored.checksum == value_checksum(value), key
    assert pair.store.stats()["checksum_failures"] == 0 and pair.store.inflight() == 0


async def test_direct_get_of_a_value_corrupted_in_memory_is_a_miss_dropped_and_counted(pair):
    """The node hashes a memory value while sending it: a value corrupted in its memory is named in the verdict,
    so the client returns a miss (never the bytes), and the node drops it and counts a checksum failure."""
    good, bad = data(6, 4 * CHUNK + 1), data(7, 3 * CHUNK)
    assert await pair.put([("good", good), ("bad", bad)]) == [True, True]
    stored = pair.store._memory.peek("bad")
    assert stored is not None
    stored.data[len(bad) // 2] ^= 0xFF  # scribble one byte of the stored value
    got = await pair.get(["good", "bad"])
    assert bytes(got[0]) == good and got[1] is None  # the bad value is never handed out
    assert pair.calls.checksum_failures == 1
    assert not pair.store.exists("bad") and pair.store.stats()["checksum_failures"] == 1
    assert (await pair.get(["bad", "good"]))[0] is None and pair.calls.checksum_failures == 1


async def test_a_put_value_corrupted_on_its_way_is_committed_but_never_read(pair):
    """The node trusts the writer's sums at commit (it never hashes a put): a value whose bytes do not match its
    sum is stored, and the first get finds it, drops it and returns a miss."""
    from libs.gcache.direct import checksums

    value = data(11, 2 * CHUNK)

    async def wrong_sums() -> list[int]:
        return [(await asyncio.to_thread(checksums, [value]))[0] ^ 1]
    assert await pair.calls.put(pair.address, [("off", value)], pair.deadline(), wrong_sums) == [True]
    assert pair.store.exists("off")
    assert await pair.get(["off"]) == [None]
    assert not pair.store.exists("off") and pair.store.stats()["checksum_failures"] == 1


async def test_a_put_whose_sums_are_garbage_or_never_come_is_aborted_and_answered():
    """Garbage sums abort the put at once with an error reply; sums that never come abort it at the put timeout
    (its values landed, so the connection stays); nothing becomes visible either way."""
    from libs.gcache.direct import decode, encode
    from libs.transfer.protocol import message_tag

    p = await Pair().start(put_timeout_s=1.0)
    try:
        conn = await p.client_engine.connect(p.address)
        answers: dict[int, dict] = {}
        p.client_engine.set_message_handler(lambda c, mid, body: answers.__setitem__(mid, decode(body)))
        value = data(12, CHUNK)
        for msg_id, sums in ((21, {"op": "sums", "sums": ["x"]}), (22, None)):
            conn.post_message(msg_id, encode({"op": "put", "chunk": CHUNK, "items": [[f"k{msg_id}", CHUNK]]}))
            sent = conn.link.post_send(message_tag(conn.link.nonce, msg_id, 0), np.frombuffer(value, dtype=np.uint8))
            if sums is not None:
                conn.post_message(msg_id, encode(sums))
            await bounded(sent, HANG)
        await bounded(_until(lambda: len(answers) == 2), 10)
        assert "error" in answers[21] and "error" in answers[22], answers
        assert "did not come" in answers[22]["error"]
        assert p.store.inflight() == 0 and p.store.stats()["aborted"] == 2 and not conn.closed
        assert not p.store.exists("k21") and not p.store.exists("k22")
        conn.post_message(23, encode({"op": "sums", "sums": [1]}))  # no such put: an error, nothing else
        await bounded(_until(lambda: 23 in answers), 10)
        assert "error" in answers[23]
    finally:
        await p.close()


async def test_a_client_connection_dropped_mid_put_aborts_the_put_at_once(pair):
    """The client announces a put and sends none of its chunks, then its connection drops (as when it dies): the
    slot is aborted at once (not at the put timeout), nothing becomes visible, and a second writer succeeds."""
    from libs.gcache.direct import encode
    from libs.transfer import PeerDisconnected

    value = data(8, 4 * CHUNK)
    conn = await pair.client_engine.connect(pair.address)
    conn.post_message(999, encode({"op": "put", "chunk": CHUNK, "items": [["dying", len(value)]]}))
    await bounded(_until(lambda: pair.store.inflight() == 1), HANG)
    assert not pair.store.exists("dying")
    await conn.drop(PeerDisconnected("client died"))
    await bounded(_until(lambda: pair.store.inflight() == 0), 5)
    assert not pair.store.exists("dying") and pair.store.stats()["aborted"] == 1
    assert await pair.put([("dying", b"second writer")]) == [True]  # (a new connection is dialled)
    assert [bytes(v) for v in await pair.get(["dying"])] == [b"second writer"]


async def test_a_put_whose_chunks_never_come_is_aborted_at_the_put_timeout():
    from libs.gcache.direct import encode

    p = await Pair().start(put_timeout_s=1.0)
    try:
        conn = await p.client_engine.connect(p.address)
        conn.post_message(7, encode({"op": "put", "chunk": CHUNK, "items": [["stalled", 3 * CHUNK]]}))
        await bounded(_until(lambda: p.store.inflight() == 1), HANG)
        await bounded(_until(lambda: p.store.inflight() == 0), 10)
        assert not p.store.exists("stalled") and p.store.stats()["aborted"] == 1
    finally:
        await p.close()


async def test_a_get_abandoned_at_its_deadline_leaves_nothing_pending(pair):
    """A get given up at each point its deadline can strike: before the node's reply (the late reply's values
    are drained into scratch memory as an orphan's), as the reply comes (set just before or just after the
    caller's wait is cancelled: its values are drained all the same), and while its receives are posted (the
    drain bound). Each
    time the node's sends complete (its in-flight gets go back to 0), no connection is dropped, and the next
    call reads the value."""
    from libs.transfer import TransferError

    value = data(9, 8 * CHUNK)
    assert await pair.put([("v", value)]) == [True]
    # bounds no busy machine reaches: the drain into scratch memory must do it, not a dropped connection (which
    # the contract allows past the drain bound, and which would also bring the in-flight count back to 0)
    pair.calls.drain_timeout_s = 30.0
    pair.direct_node.config = pair.direct_node.config.model_copy(update={"send_timeout_s": 60.0})

    async def settled() -> None:
        await bounded(_until(lambda: pair.node.inflight_gets == 0), 30)
        assert [bytes(v) for v in await pair.get(["v"])] == [value]
        assert pair.calls.drops == 0

    # 1. the reply comes after the deadline
    reply = pair.direct_node._reply
    loop = asyncio.get_running_loop()
    pair.direct_node._reply = lambda conn, msg_id, msg: (  # type: ignore[method-assign]
        loop.call_later(0.3, reply, conn, msg_id, msg) if "sizes" in msg or "bad" in msg
        else reply(conn, msg_id, msg))
    with pytest.raises(TimeoutError):
        await pair.get(["v"], timeout=0.05)
    pair.direct_node._reply = reply  # type: ignore[method-assign]
    await asyncio.sleep(0.5)
    await settled()

    # 2. the deadline strikes as the reply comes: the caller is cancelled just after the reply was set (before
    # it wakes up to take it), or just before (its wait's future is cancelled, then the reply finds it so);
    # nobody takes the reply either way, and its values come all the same
    on_message = pair.calls._on_message
    racing_get: list[asyncio.Future] = []  # the get the handler below cancels

    def racing(cancel_first: bool):
        def handler(conn, msg_id, body):
            sizes = bool(racing_get) and b"sizes" in body
            if sizes and cancel_first:
                racing_get[0].cancel()
            on_message(conn, msg_id, body)
            if sizes and not cancel_first:
                racing_get[0].cancel()
        return handler

    for cancel_first in (False, True):
        pair.client_engine.set_message_handler(racing(cancel_first))
        racing_get[:] = [asyncio.ensure_future(pair.get(["v"]))]
        with pytest.raises(asyncio.CancelledError):
            await racing_get[0]
        racing_get.clear()
        pair.client_engine.set_message_handler(on_message)
        await settled()

    # 3. given up with its receives posted (a deadline shorter than the transfer, when the machine allows it)
    for _ in range(20):
        try:
            got = await pair.get(["v"], timeout=0.0002)
        except (TimeoutError, TransferError):
            break
        assert bytes(got[0]) == value
    await settled()


async def test_node_garbage_requests_are_answered_with_errors(pair):
    from libs.gcache.direct import DirectError, decode

    conn = await pair.client_engine.connect(pair.address)
    answers: dict[int, dict] = {}
    pair.client_engine.set_message_handler(lambda c, mid, body: answers.__setitem__(mid, decode(body)))
    conn.post_message(1, b"not json")
    conn.post_message(2, b'{"op": "put", "chunk": 0, "items": []}')
    conn.post_message(3, b'{"op": "nope", "chunk": 4096}')
    conn.post_message(4, b'{"op": "put", "chunk": 4096, "items": [["k", -1]]}')
    conn.post_message(5, b'{"op": "bad", "keys": ["k"]}')
    await bounded(_until(lambda: len(answers) == 5), HANG)
    assert all("error" in a for a in answers.values()), answers
    assert pair.store.inflight() == 0 and not conn.closed
    assert issubclass(DirectError, Exception)


async def _until(cond, step: float = 0.02) -> None:
    while not cond():
        await asyncio.sleep(step)


# --------------------------------------------------------------------------- with node processes

DYING_DIRECT_CLIENT = r"""
import asyncio, sys
from libs.gcache.direct import encode
from libs.transfer import create_engine
from libs.transfer.protocol import message_tag
from libs.gcache import wire

async def main(address):
    value = bytes(range(256)) * (64 * 1024 * 4)  # 64 MiB
    chunk = 1 << 20
    engine = create_engine()
    await engine.start()
    conn = await engine.connect(address)
    conn.post_message(1, encode({"op": "put", "chunk": chunk, "items": [["dying:direct", len(value)]]}))
    views = wire.chunk_views(value, chunk)
    sends = [conn.link.post_send(message_tag(conn.link.nonce, 1, k), v) for k, v in enumerate(views[:len(views) // 2])]
    await asyncio.wait(sends, timeout=20)
    print("stalled", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def nodes(nats_server, tmp_path_factory):
    n = CacheNodes(nats_server.url, tmp_path_factory.mktemp("gcache-direct"))
    n.start("node-a")
    n.start("node-b")
    try:
        yield n
    finally:
        n.stop()


async def test_gcache_client_takes_the_direct_path_to_node_processes(nodes):
    client = await nodes.client()
    try:
        values = {f"d:{i}": os.urandom(size) for i, size in enumerate([1, 5 << 20, 17 << 20, 0, 3 << 20])}
        before = {n: await nodes.details(n) for n in ("node-a", "node-b")}
        assert await client.put(list(values.items())) == [True] * len(values)
        got = await client.get(list(values))
        assert [bytes(g) for g in got] == list(values.values())
        after = {n: await nodes.details(n) for n in ("node-a", "node-b")}
        used = [n for n in after if int(after[n]["direct_puts"]) > int(before[n]["direct_puts"])]
        assert used and all(int(after[n]["direct_gets"]) > int(before[n]["direct_gets"]) for n in used)
        assert sum(w.direct.calls for w in client._workers if w.direct) >= 2 * len(used)
        # a started service's heap is frozen (libs/service: full collections skip its startup objects)
        assert all(int(after[n]["gc_frozen_objects"]) > 10_000 for n in after), after
    finally:
        await client.close()


async def test_a_client_killed_halfway_through_a_direct_put_leaves_no_visible_key(nodes):
    client = await nodes.client()
    key = "dying:direct"
    node = client.home(key)
    address = (await nodes.details(node))["address"]
    child = subprocess.Popen([sys.executable, "-c", DYING_DIRECT_CLIENT, address], cwd=ROOT,
                             env={**os.environ, **UCX_ENV}, stdout=subprocess.PIPE, text=True)
    try:
        line = await bounded(asyncio.to_thread(child.stdout.readline), HANG)
        assert line.strip() == "stalled", line
        assert (await nodes.details(node))["inflight_puts"] == "1"
        assert await client.exists([key]) == [False] and await client.put([(key, b"x")]) == [False]
        child.send_signal(signal.SIGKILL)
        child.wait(10)

        async def reclaimed() -> bool:
            return (await nodes.details(node))["inflight_puts"] == "0"
        async with asyncio.timeout(3.0):  # at once (its connection closed), well inside the put timeout (4 s)
            while not await reclaimed():
                await asyncio.sleep(0.05)
        assert await client.get([key]) == [None]
        assert await client.put([(key, b"second writer")]) == [True]
        assert [bytes(v) for v in await client.get([key])] == [b"second writer"]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        await client.close()
