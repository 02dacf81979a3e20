"""libs.bus.RegistryView on a real JetStream KV: a local view kept by the watcher, fresh entries only."""

from __future__ import annotations

import asyncio
import time

import pytest

from libs.bus import HeartbeatConfig, Registry, RegistryView, ViewConfig
from libs.bus.registry import entry_key
from protos import subjects
from protos.base import encode
from protos.messages import RegistryEntry, Role, WorkerLoad
from tests.fixtures.waits import until

pytestmark = pytest.mark.integration

TTL = HeartbeatConfig(ttl_s=1, interval_s=0.25)




async def test_view_follows_joins_loads_leaves_and_expiry_and_never_admits_a_stale_entry(bus):
    registry = await Registry.open(bus, bucket=subjects.registry_bucket("view_test"))
    # an entry of an earlier run the store kept (no TTL on the message, heartbeat long ago): never live
    ghost = RegistryEntry(role=Role.WORKER, instance_id="ghost", heartbeat_at=time.time() - 100, ttl_s=5)
    await bus.js.publish(f"$KV.{registry.bucket}.{entry_key(Role.WORKER, 'ghost')}", encode(ghost))
    view = RegistryView(registry, config=ViewConfig(prune_interval_s=0.1))
    seen: list[tuple[str, str]] = []

    def state() -> str:  # for a failure message: what the view holds, and how old each heartbeat is
        now = time.time()
        return f"{[(e.instance_id, round(now - e.heartbeat_at, 2)) for e in view.entries()]}, " \
               f"watch errors {view.watch_errors}"
    view.add_listener(lambda kind, e: seen.append((kind.value, e.instance_id)))
    a = registry.register(RegistryEntry(role=Role.WORKER, instance_id="a", started_at=1.0), TTL)
    b = registry.register(RegistryEntry(role=Role.DECODE, instance_id="b"), TTL)
    await a.start()
    try:
        assert await view.start()
        assert [e.instance_id for e in view.live(time.time())] == ["a"] and seen == [("join", "a")]
        await b.start()
        await until(lambda: ("join", "b") in seen, what="b joins by the watch")
        assert [e.instance_id for e in view.live(time.time(), Role.DECODE)] == ["b"]
        # heartbeats carry fresh load into the view without a second join
        a.entry = a.entry.model_copy(update={"load": WorkerLoad(running=3)})
        await until(lambda: (view.live(time.time(), Role.WORKER)[0].load or WorkerLoad()).running == 3,
                    what="a's new load in the view")
        assert await view.resync() and seen == [("join", "a"), ("join", "b")]  # a listing changes nothing
        # a restart under the same id (new started_at) before the TTL ran out: the old one left
        a.entry = a.entry.model_copy(update={"started_at": 2.0})
        await until(lambda: seen[-2:] == [("leave", "a"), ("join", "a")], what="a restarted")
        await b.stop()  # deregistered: leaves at once
        await until(lambda: ("leave", "b") in seen, what=lambda: f"b leaves (seen {seen}, view {state()})")
        await a.stop(deregister=False)  # as if killed: the view drops it within its TTL
        stopped = time.monotonic()
        await until(lambda: not view.live(time.time()) and seen[-1] == ("leave", "a"), timeout=TTL.ttl_s + 10,
                    what="a expires")  # (its LEAVE follows the store check of `check_expired`)
        assert time.monotonic() - stopped < TTL.ttl_s + 10 and seen[-1] == ("leave", "a")
        assert "ghost" not in {e.instance_id for e in view.entries()}
    finally:
        await view.stop()
        await a.stop()
        await b.stop()


class _StallingRegistry(Registry):
    """Its first watch goes quiet once `stall` is set (as a watch whose consumer lived on a NATS node that died:
    it delivers nothing, not even an error); later watches work."""

    stall = False
    watches = 0

    async def watch(self, *args, **kwargs):
        self.watches += 1
        first = self.watches == 1
        async for event in super().watch(*args, **kwargs):
            while first and self.stall:
                await asyncio.sleep(3600)
            yield event


async def test_a_watch_that_goes_quiet_does_not_make_live_instances_leave(bus):
    opened = await Registry.open(bus, bucket=subjects.registry_bucket("view_stall"))
    registry = _StallingRegistry(bus, opened._kv, opened.bucket)
    view = RegistryView(registry, config=ViewConfig(prune_interval_s=0.1, stale_check_s=0.3))
    seen: list[tuple[str, str]] = []
    view.add_listener(lambda kind, e: seen.append((kind.value, e.instance_id)))
    a = registry.register(RegistryEntry(role=Role.WORKER, instance_id="a"), TTL)
    await a.start()
    try:
        assert await view.start() and seen == [("join", "a")]
        registry.stall = True
        stalled = time.monotonic()
        # well past the TTL (+ slack): the store holds a's fresh heartbeats, the quiet watch none of them
        await until(lambda: time.monotonic() - stalled > 3 * (TTL.ttl_s + view.config.slack_s), timeout=30,
                    what="three TTLs")
        assert seen == [("join", "a")] and [e.instance_id for e in view.live(time.time())] == ["a"]
        assert view.watch_stalls >= 1 and registry.watches >= 2  # the listing found it out; a new watch runs
        a.entry = a.entry.model_copy(update={"load": WorkerLoad(running=5)})  # the new watch delivers refreshes
        await until(lambda: (view.live(time.time())[0].load or WorkerLoad()).running == 5, what="a's load")
        await a.stop(deregister=False)  # a real death is still seen: the store has no fresher heartbeat
        await until(lambda: not view.live(time.time()) and seen[-1] == ("leave", "a"), timeout=TTL.ttl_s + 10,
                    what="a expires")
    finally:
        await view.stop()
        await a.stop()


async def test_time_the_registry_could_not_be_written_does_not_age_entries(bus):
    registry = await Registry.open(bus, bucket=subjects.registry_bucket("view_outage"))
    outages: list[tuple[float, float | None]] = []
    view = RegistryView(registry, config=ViewConfig(prune_interval_s=0.1, stale_check_s=0.3, outage_keep_s=4.0),
                        outages=lambda: outages)
    a = registry.register(RegistryEntry(role=Role.WORKER, instance_id="a"), TTL)
    await a.start()
    try:
        assert await view.start()
        await a.stop(deregister=False)  # a's last heartbeat; from now on, as if no put could be stored
        outages.append((time.time(), None))
        began = time.monotonic()
        await until(lambda: time.monotonic() - began > TTL.ttl_s + 2, timeout=30, what="past a's TTL")
        assert [e.instance_id for e in view.live(time.time())] == ["a"]  # the outage is not counted
        await until(lambda: not view.live(time.time()), timeout=TTL.ttl_s + 10,
                    what="a expires once outage_keep_s is spent")
        assert time.monotonic() - began >= 4.0
    finally:
        await view.stop()
        await a.stop()


def test_registration_reports_the_windows_its_puts_failed():
    from libs.bus.registry import Registration

    reg = Registration(None, RegistryEntry(role=Role.WORKER, instance_id="a"), TTL)  # type: ignore[arg-type]
    reg._put_done(True)
    ok_at = reg._put_at
    assert reg.unwritable() == []
    reg._put_started = time.time() - 10 * TTL.interval_s  # a put pending for long: not stored either
    assert reg.unwritable() == [(ok_at, None)]
    reg._put_done(False)
    reg._put_done(False)
    assert reg.unwritable() == [(ok_at, None)]
    reg._put_done(True)
    [(start, end)] = reg.unwritable()
    assert start == ok_at and end is not None and end >= start
