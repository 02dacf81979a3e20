"""Registry on a real JetStream KV: join, heartbeat keeps alive, expiry after TTL, watch events."""

import asyncio
import itertools
import time

import pytest

from libs.bus import HeartbeatConfig, Registry, RegistryEventKind
from libs.bus.registry import _to_event, entry_key
from protos import encode
from protos.messages import RegistryEntry, Role

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
    known: set[str] = set()
    raw = encode(entry(Role.ROUTER, "r1"))
    join = _to_event("router.r1", raw, None, known)
    assert join is not None and join.kind == RegistryEventKind.JOIN and join.entry.instance_id == "r1"
    assert _to_event("router.r1", raw, None, known) is None  # heartbeat refresh
    assert _to_event("router.r9", b"", "PURGE", known) is None  # never seen
    leave = _to_event("router.r1", b"", "PURGE", known)
    assert leave is not None and leave.kind == RegistryEventKind.LEAVE and known == set()
    assert _to_event("router.bad", b"{}", None, known) is None  # malformed entry ignored


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
