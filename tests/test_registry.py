"""Registry on a real JetStream KV: join, heartbeat keeps alive, expiry after TTL, watch events, and the
freshness rule (stale entries are never listed nor joined, even when the store keeps them)."""

import asyncio
import contextlib
import itertools
import signal
import time

import pytest

from libs.bus import Bus, HeartbeatConfig, Registry, RegistryEventKind
from libs.bus.registry import Registration, WatchState, entry_key
from protos import encode
from protos.messages import RegistryEntry, Role
from tests.fixtures.nats import start_nats_server

pytestmark = pytest.mark.timeout(60)
_bucket_ids = itertools.count()


def entry(role: Role, iid: str, **kw) -> RegistryEntry:
    return RegistryEntry(role=role, instance_id=iid, address=f"tcp://127.0.0.1/{iid}", capacity=8, **kw)


async def fresh_registry(bus) -> Registry:
    return await Registry.open(bus, bucket=f"test_registry_{next(_bucket_ids)}")


async def wait_until(predicate, timeout: float, step: float = 0.1) -> bool:
    async with asyncio.timeout(timeout):
        while not await predicate():
            await asyncio.sleep(step)
    return True


@pytest.mark.unit
def test_heartbeat_config_validation():
    with pytest.raises(ValueError, match="must be > 0 and < ttl_s"):
        HeartbeatConfig(ttl_s=1, interval_s=1.0)
    with pytest.raises(ValueError, match="ttl_s must be >= 1"):
        HeartbeatConfig(ttl_s=0, interval_s=0.1)


@pytest.mark.unit
def test_event_translation_reports_join_once_and_leave_only_for_known():
    state = WatchState()
    now = time.time()
    raw = encode(entry(Role.ROUTER, "r1"))
    join = state.update("router.r1", raw, None, now)
    assert join is not None and join.kind == RegistryEventKind.JOIN and join.entry.instance_id == "r1"
    assert state.update("router.r1", raw, None, now) is None  # heartbeat refresh
    assert state.update("router.r9", b"", "PURGE", now) is None  # never seen
    leave = state.update("router.r1", b"", "PURGE", now)
    assert leave is not None and leave.kind == RegistryEventKind.LEAVE and state.known == {}
    assert state.update("router.bad", b"{}", None, now) is None  # malformed entry ignored
    updates = WatchState(refreshes=True)
    assert updates.update("router.r1", raw, None, now).kind == RegistryEventKind.JOIN
    update = updates.update("router.r1", raw, None, now)
    assert update is not None and update.kind == RegistryEventKind.UPDATE and update.entry.instance_id == "r1"


def stamped(role: Role, iid: str, heartbeat_at: float, ttl_s: int = 2) -> bytes:
    return encode(entry(role, iid).model_copy(update={"heartbeat_at": heartbeat_at, "ttl_s": ttl_s}))


@pytest.mark.unit
def test_watch_state_never_joins_a_stale_entry_and_sweeps_one_that_stops_heartbeating():
    state = WatchState()
    t0 = 1_000_000.0
    assert state.update("decode.ghost", stamped(Role.DECODE, "ghost", t0 - 60), None, t0) is None
    assert state.sweep(t0) == [] and state.known == {}
    join = state.update("decode.d1", stamped(Role.DECODE, "d1", t0), None, t0)
    assert join is not None and join.kind == RegistryEventKind.JOIN
    assert state.sweep(t0 + 2.5) == []  # within ttl (2 s) + slack (1 s)
    assert state.update("decode.d1", stamped(Role.DECODE, "d1", t0 + 2.5), None, t0 + 2.5) is None  # refresh
    assert state.sweep(t0 + 5.0) == []  # the refresh moved the deadline to t0 + 5.5
    [leave] = state.sweep(t0 + 6.0)
    assert (leave.kind, leave.key) == (RegistryEventKind.LEAVE, "decode.d1") and state.known == {}
    assert state.sweep(t0 + 7.0) == []
    rejoin = state.update("decode.d1", stamped(Role.DECODE, "d1", t0 + 7.0), None, t0 + 7.0)
    assert rejoin is not None and rejoin.kind == RegistryEventKind.JOIN  # heartbeating again: back
    leave = state.update("decode.d1", stamped(Role.DECODE, "d1", t0), None, t0 + 7.0)
    assert leave is not None and leave.kind == RegistryEventKind.LEAVE  # a stale put of a known key


class _SwallowingRegistry:
    """Pure fake for the heartbeat loop alone: its put swallows a cancellation that lands while it waits, as
    Python 3.11's `asyncio.wait_for` (inside nats-py's request) does when the ack arrives at the same time."""

    def __init__(self) -> None:
        self.puts = 0
        self.deleted = 0
        self.in_flight = False

    async def put(self, entry, ttl_s):
        self.puts += 1
        self.in_flight = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.05)
        self.in_flight = False

    async def deregister(self, role, instance_id):
        self.deleted += 1


@pytest.mark.unit
async def test_stop_ends_the_heartbeat_even_when_a_put_swallows_the_cancellation():
    fake = _SwallowingRegistry()
    reg = Registration(fake, entry(Role.DECODE, "d1"), HeartbeatConfig(ttl_s=1, interval_s=0.01))  # type: ignore[arg-type]
    await reg.start()
    await wait_until(lambda: _now(fake.puts >= 3 and fake.in_flight), timeout=5, step=0.001)
    stop = asyncio.create_task(reg.stop())  # while a put is in flight: it swallows the cancellation
    done, _ = await asyncio.wait({stop}, timeout=reg.STOP_TIMEOUT_S + 2)
    assert done, "stop() waited for a heartbeat that never ended"  # the old loop went on putting
    after = fake.puts
    await asyncio.sleep(0.2)
    assert fake.puts == after and fake.deleted == 1  # no put after stop: the entry cannot come back


async def _now(value: bool) -> bool:
    return value


@pytest.mark.integration
async def test_register_list_by_role_and_deregister(bus):
    reg = await fresh_registry(bus)
    assert await reg.list() == []
    hb = HeartbeatConfig(ttl_s=5, interval_s=1.0)
    a = reg.register(entry(Role.PREFILL, "p1", labels={"bucket": "8k"}), hb)
    b = reg.register(entry(Role.DECODE, "d1"), hb)
    await a.start()
    await b.start()
    assert [e.instance_id for e in await reg.list()] == ["d1", "p1"]
    prefill = await reg.list(Role.PREFILL)
    assert [e.model_copy(update={"heartbeat_at": 0.0, "ttl_s": 0}) for e in prefill] == [a.entry]
    assert prefill[0].labels == {"bucket": "8k"} and prefill[0].ttl_s == a.heartbeat.ttl_s
    assert prefill[0].fresh(time.time()) and not prefill[0].fresh(time.time() + a.heartbeat.ttl_s + 2)
    await a.stop()
    assert [e.instance_id for e in await reg.list()] == ["d1"]
    await b.stop()
    assert await reg.list() == []


@pytest.mark.integration
async def test_heartbeat_keeps_entry_alive_past_ttl_and_expiry_removes_it(bus):
    reg = await fresh_registry(bus)
    live = reg.register(entry(Role.ROUTER, "alive"), HeartbeatConfig(ttl_s=1, interval_s=0.25))
    await live.start()
    await reg.put(entry(Role.ROUTER, "silent"), ttl_s=1)  # registered once, never refreshed
    assert len(await reg.list()) == 2

    async def only_alive_left() -> bool:
        return [e.instance_id for e in await reg.list()] == ["alive"]

    # The silent one must go within its TTL (+ server expiry scan slack); the live one survives
    # several TTLs because it heartbeats.
    assert await wait_until(only_alive_left, timeout=3.0)
    await asyncio.sleep(1.5)
    assert await only_alive_left()
    await live.stop()


@pytest.mark.integration
async def test_watch_sees_existing_joins_and_leaves(bus):
    reg = await fresh_registry(bus)
    hb = HeartbeatConfig(ttl_s=1, interval_s=0.2)
    first = reg.register(entry(Role.ROUTER, "w1"), hb)
    await first.start()
    events = reg.watch()
    try:
        async with asyncio.timeout(10):
            ev = await anext(events)
            assert (ev.kind, ev.key) == (RegistryEventKind.JOIN, "router.w1")  # existing entry reported first
            second = reg.register(entry(Role.DECODE, "w2"), hb)
            await second.start()
            ev = await anext(events)
            assert (ev.kind, ev.key, ev.entry.role) == (RegistryEventKind.JOIN, "decode.w2", Role.DECODE)
            await first.stop()  # explicit deregistration
            ev = await anext(events)
            assert (ev.kind, ev.key) == (RegistryEventKind.LEAVE, "router.w1")
            await second.stop(deregister=False)  # stops heartbeating: expiry must be reported
            ev = await anext(events)
            assert (ev.kind, ev.key) == (RegistryEventKind.LEAVE, entry_key(Role.DECODE, "w2"))
    finally:
        await events.aclose()


async def put_kept_by_store(bus, reg: Registry, iid: str, heartbeat_at: float, ttl_s: int = 1) -> None:
    """Store an entry whose own stamp says `ttl_s` but that the server keeps for 60 s: the store's expiry
    cannot be what removes it."""
    raw = stamped(Role.DECODE, iid, heartbeat_at, ttl_s)
    await bus.js.publish(f"$KV.{reg.bucket}.{entry_key(Role.DECODE, iid)}", raw, msg_ttl=60)


@pytest.mark.integration
async def test_list_drops_an_entry_the_store_keeps_after_its_heartbeat_went_stale(bus):
    reg = await fresh_registry(bus)
    await put_kept_by_store(bus, reg, "ghost", time.time() - 30)
    await reg.put(entry(Role.DECODE, "live"), ttl_s=5)
    assert [e.instance_id for e in await reg.list()] == ["live"]
    assert [e.instance_id for e in await reg.list(Role.DECODE)] == ["live"]

    async def reaped() -> bool:  # listing removed the ghost from the store; its delete marker expires too
        info = await bus.js.stream_info(f"KV_{reg.bucket}", subjects_filter=">")
        return set(info.state.subjects or {}) == {f"$KV.{reg.bucket}.decode.live"}

    assert await wait_until(reaped, timeout=10)


@pytest.mark.integration
async def test_watch_reports_leave_when_heartbeats_stop_even_if_the_store_keeps_the_entry(bus):
    reg = await fresh_registry(bus)
    await put_kept_by_store(bus, reg, "ghost", time.time() - 30)
    await put_kept_by_store(bus, reg, "quiet", time.time(), ttl_s=1)  # fresh now, never refreshed
    events = reg.watch(sweep_s=0.2)
    try:
        async with asyncio.timeout(10):
            ev = await anext(events)
            assert (ev.kind, ev.key) == (RegistryEventKind.JOIN, "decode.quiet")  # the ghost never joins
            ev = await anext(events)  # stale after 1 s ttl + 1 s slack: a LEAVE from the sweep
            assert (ev.kind, ev.key) == (RegistryEventKind.LEAVE, "decode.quiet")
    finally:
        await events.aclose()
    assert [e.instance_id for e in await reg.list()] == []


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_ghosts_after_nats_sigkill_and_restart_on_the_persisted_store_are_never_listed(tmp_path):
    """Issue #14's ghost scenario: instances die (their entries expire and are removed), then nats-server is
    SIGKILLed and restarted on the same store. The restarted server brings the removed entries back (their
    removal was not on disk yet) and keeps the last one, which it never expired, for a while; neither `list`
    nor `watch` may report any of them."""
    server = start_nats_server(str(tmp_path / "store"))
    hb = HeartbeatConfig(ttl_s=1, interval_s=0.25)
    try:
        bus = await Bus.connect(server.url, name="ghost-test")
        reg = await Registry.open(bus, "ghost_registry")
        regs = [reg.register(entry(Role.DECODE, iid), hb) for iid in ("dead-decode", "dead-worker", "survivor")]
        for r in regs:
            await r.start()
        await asyncio.sleep(1.0)
        for r in regs[:2]:
            await r.stop(deregister=False)  # "SIGKILL": no deregistration, the TTL removes them
        assert await wait_until(lambda: _ids_are(reg, ["survivor"]), timeout=10)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        await regs[2].stop(deregister=False)  # nats is gone: this one dies with it
        await bus.close()
        await asyncio.sleep(2.5)  # every entry's heartbeat is now older than ttl + slack

        server = start_nats_server(server.store_dir, server.port)
        bus = await Bus.connect(server.url, name="ghost-test-2")
        reg = await Registry.open(bus, "ghost_registry")
        stored = (await bus.js.stream_info("KV_ghost_registry")).state.messages
        listed = await reg.list()
        events = reg.watch(sweep_s=0.2)
        joined = []
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1.5):
                    async for ev in events:
                        joined.append(ev)
        finally:
            await events.aclose()
        await bus.close()
    finally:
        server.stop()
    assert listed == [] and joined == [], f"ghosts: listed {listed}, watched {joined} (store held {stored})"


async def _ids_are(reg: Registry, ids: list[str]) -> bool:
    return [e.instance_id for e in await reg.list()] == ids
