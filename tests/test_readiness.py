"""Gateway liveness vs readiness: the serving-path rule (pure), the cached probe, and the three health
endpoints over the ASGI app (no NATS)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from protos.messages import RegistryEntry, Role, WorkerLoad
from services.gateway.handlers import build_app
from services.gateway.readiness import CachedListing, serving_path
from tests.fixtures.waits import until
from tests.test_gateway import FakeBackend, make_api

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]
NOW = 1_000_000.0


def entry(role: Role, iid: str, address: str = "", heartbeat_at: float = NOW) -> RegistryEntry:
    return RegistryEntry(role=role, instance_id=iid, address=address, heartbeat_at=heartbeat_at, ttl_s=2)


def test_serving_path_needs_a_worker_or_router_prefill_and_decode_with_an_address():
    assert serving_path([], NOW).missing == ("a router", "a prefill worker",
                                             "a decode worker with a KV transfer address")
    assert serving_path([entry(Role.WORKER, "w")], NOW).ready
    disagg = [entry(Role.ROUTER, "r"), entry(Role.PREFILL, "p"), entry(Role.DECODE, "d", address="ucx://d")]
    assert serving_path(disagg, NOW).ready
    no_address = [*disagg[:2], entry(Role.DECODE, "d")]
    path = serving_path(no_address, NOW)
    assert not path.ready and path.missing == ("a decode worker with a KV transfer address",)
    assert "lacks a decode worker with a KV transfer address" in path.reason
    assert serving_path(disagg[1:], NOW).missing == ("a router",)  # the gateway reaches them only via the router
    assert serving_path([entry(Role.GATEWAY, "g"), entry(Role.DECODE, "d", "ucx://d")], NOW).missing == (
        "a router", "a prefill worker")


def test_serving_path_ignores_stale_entries():
    stale = entry(Role.WORKER, "ghost", heartbeat_at=NOW - 60)
    assert not serving_path([stale], NOW).ready
    assert serving_path([stale, entry(Role.WORKER, "w")], NOW).ready


def loaded(e: RegistryEntry, full_used: int, swa_used: int = 0) -> RegistryEntry:
    return e.model_copy(update={"load": WorkerLoad(kv_full_used=full_used, kv_full_total=100, kv_swa_used=swa_used,
                                                   kv_swa_total=20)})


def test_room_needs_pages_left_on_a_complete_path():
    w, w2 = loaded(entry(Role.WORKER, "w"), 100), loaded(entry(Role.WORKER, "w2"), 10, swa_used=20)
    path = serving_path([w, w2], NOW)
    assert path.ready and not path.room and path.saturated == ("w", "w2")
    assert "no KV pages left on w, w2" in path.full_reason
    assert serving_path([w, loaded(entry(Role.WORKER, "w3"), 99, 19)], NOW).room
    assert serving_path([entry(Role.WORKER, "w4")], NOW).room  # no load report yet: assumed
    router, prefill = entry(Role.ROUTER, "r"), loaded(entry(Role.PREFILL, "p"), 5)
    full_decode = loaded(entry(Role.DECODE, "d", address="ucx://d"), 100)
    path = serving_path([router, prefill, full_decode], NOW)
    assert path.ready and not path.room and path.saturated == ("d",)
    assert serving_path([router, prefill, full_decode, loaded(entry(Role.DECODE, "d2", "ucx://d2"), 3)], NOW).room
    assert serving_path([w, router, prefill, loaded(entry(Role.DECODE, "d2", "ucx://d2"), 3)], NOW).room


def test_room_of_an_arena_worker_is_its_units():
    """With one KV arena the per-group totals move with the other group's use (a group can show every page
    in use while the arena has room): room is units in use or promised < units."""
    def arena(iid: str, units_used: int) -> RegistryEntry:
        return entry(Role.WORKER, iid).model_copy(update={"load": WorkerLoad(
            kv_full_used=12, kv_full_total=12, kv_swa_used=3, kv_swa_total=3, kv_units_used=units_used,
            kv_units_total=100)})
    assert serving_path([arena("a", 40)], NOW).room
    path = serving_path([arena("a", 100)], NOW)
    assert not path.room and path.saturated == ("a",)


async def test_ready_with_capacity_is_503_no_room_while_every_worker_is_full():
    entries = [loaded(entry(Role.WORKER, "w", heartbeat_at=time.time()), 100)]

    async def listing():
        return list(entries)

    app = build_app(listing, "gw-r", make_api(FakeBackend()))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        assert (await c.get("/health/ready")).status_code == 200  # a path exists: ready (the default probe)
        full = await c.get("/health/ready", params={"capacity": "true"})
        assert full.status_code == 503 and full.headers["retry-after"] == "3"
        assert full.json()["status"] == "no_room" and full.json()["saturated"] == ["w"]
        assert "every serving path is full" in full.json()["error"]
        assert (await c.get("/health")).json()["room"] is False
        entries[0] = loaded(entries[0], 50)
        await asyncio.sleep(0.6)  # the probe's cached read
        ok = await c.get("/health/ready", params={"capacity": "true"})
        assert ok.status_code == 200 and ok.json() == {"status": "ready", "gateway": "gw-r", "room": True}


async def test_cached_listing_serves_its_last_listing_at_once_and_refreshes_it_in_the_background():
    calls = 0
    down = False
    clock = [0.0]

    async def listing():
        nonlocal calls
        calls += 1
        if down:
            raise TimeoutError("registry down")
        return [entry(Role.WORKER, f"w{calls}")]

    def ids(entries):
        return [e.instance_id for e in entries]

    cached = CachedListing(listing, max_age_s=0.5, clock=lambda: clock[0])
    assert ids(await cached()) == ["w1"]  # the first read is waited for
    await asyncio.gather(cached(), cached())
    assert calls == 1 and cached.served_stale == 0
    clock[0] = 0.6  # older than max_age: read again before it is served (readiness probes)
    assert ids(await cached()) == ["w2"] and calls == 2
    clock[0] = 1.2  # the request path (wait=False): served at once, one read in the background
    assert ids(await cached(wait=False)) == ["w2"] and ids(await cached(wait=False)) == ["w2"]
    await until(lambda: calls == 3, what="the background read")
    assert ids(await cached(wait=False)) == ["w3"] and calls == 3
    assert ids(await cached(fresh=True)) == ["w4"]  # a fresh call waits for its read
    down, clock[0] = True, 1.8
    assert ids(await cached()) == ["w4"] and calls == 5  # read 5 failed: the last listing
    assert ids(await cached(fresh=True)) == ["w4"] and calls == 5  # failing: no wait, even for a fresh call
    clock[0] = 2.4
    down = False
    assert ids(await cached()) == ["w4"]  # failing: at once, read 6 in the background
    await until(lambda: calls == 6, what="the read after the failure")
    assert ids(await cached()) == ["w6"] and cached.served_stale == 5
    down, clock[0] = True, 40.0  # past stale_ok_s: the failure is raised
    with pytest.raises(TimeoutError):
        await cached()

    first_fails = CachedListing(listing, max_age_s=0.5, clock=lambda: clock[0])
    with pytest.raises(TimeoutError):  # no listing to fall back on: raised ...
        await first_fails()
    down = False
    assert ids(await first_fails()) == ["w9"]  # ... and not cached


async def test_health_endpoints_tell_live_from_ready():
    entries: list[RegistryEntry] = []

    async def listing():
        return list(entries)

    app = build_app(listing, "gw-r", make_api(FakeBackend()))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        live = await c.get("/health/live")
        assert live.status_code == 200 and live.json() == {"status": "live", "gateway": "gw-r"}
        ready = await c.get("/health/ready")
        assert ready.status_code == 503 and ready.headers["retry-after"] == "3"
        assert ready.json()["status"] == "not_ready" and "a prefill worker" in ready.json()["missing"]
        assert "no complete serving path" in ready.json()["error"]
        health = await c.get("/health")
        assert health.status_code == 503 and health.headers["retry-after"] == "3"
        assert health.json()["ready"] is False and health.json()["services"] == {}

        entries.extend([entry(Role.ROUTER, "r", heartbeat_at=time.time()),
                        entry(Role.WORKER, "w", heartbeat_at=time.time() - 60)])  # a ghost worker
        assert (await c.get("/health")).status_code == 503
        entries.append(entry(Role.WORKER, "w2", heartbeat_at=time.time()))
        health = await c.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["ready"] is True
        assert health.json()["services"]["worker"] == ["w", "w2"]  # the body lists what the registry listed
        await asyncio.sleep(0.6)  # the readiness probe re-reads the registry after 0.5 s
        ready = await c.get("/health/ready")
        assert ready.status_code == 200 and ready.json() == {"status": "ready", "gateway": "gw-r"}


async def test_ready_is_503_with_the_cause_when_the_registry_is_unreachable():
    async def broken():
        raise TimeoutError("listing registry bucket windserve_registry took over 2s")

    app = build_app(broken, "gw-r")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        ready = await c.get("/health/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "unavailable"
        assert "registry unreachable" in ready.json()["error"] and ready.headers["retry-after"] == "1"
        assert (await c.get("/health/live")).status_code == 200
