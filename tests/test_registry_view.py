"""libs.bus.RegistryView on a real JetStream KV: a local view kept by the watcher, fresh entries only."""

from __future__ import annotations

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
        await until(lambda: not view.live(time.time()), timeout=TTL.ttl_s + 10, what="a expires")
        assert time.monotonic() - stopped < TTL.ttl_s + 10 and seen[-1] == ("leave", "a")
        assert "ghost" not in {e.instance_id for e in view.entries()}
    finally:
        await view.stop()
        await a.stop()
        await b.stop()
