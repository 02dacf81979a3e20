"""The router service on a real nats-server: its registry view, the KV events of real `KVCache`s, snapshot resyncs,
replicas sharing picks, hit feedback.

The workers here are a harness: real `libs.kvcache.KVCache` instances registered in the real registry with their
layout labels (heartbeating), publishing their drained events as `KVEventBatch` and answering `kv_snapshot` with
`libs.routing.take_snapshot`; requests run on the cache alone (no model). The routers are real `RouterService`s.
"""

from __future__ import annotations

import random
import time
import uuid

import pytest
from prometheus_client import REGISTRY

from libs.bus import Bus, HeartbeatConfig, Registry, RemoteError
from libs.kvcache import DEFAULT_HASH_SEED, KVCache, KVCacheConfig, KVEvent, block_hashes
from libs.routing.snapshot import take_snapshot
from libs.worker.kv_wire import wire_event
from protos import subjects
from protos.messages import (
    KVEventBatch,
    KVHitReport,
    KVSnapshotReply,
    KVSnapshotRequest,
    RegistryEntry,
    Role,
    RouteReply,
    RouteRequest,
)
from services.router.config import RouterConfig
from services.router.service import RouterService
from tests.fixtures.waits import until

pytestmark = pytest.mark.integration

P, WINDOW = 4, 8
CFG = KVCacheConfig(page_size=P, window=WINDOW, num_full_pages=48, num_swa_pages=14)  # SWA KV gets evicted
LAYOUT = {"kv_page_size": str(P), "kv_window": str(WINDOW), "kv_rebuild_tokens": "0",
          "kv_hash_seed": str(DEFAULT_HASH_SEED)}
TTL = HeartbeatConfig(ttl_s=1, interval_s=0.25)


class CacheWorker:
    """A worker's KV side without a model (module docstring)."""

    def __init__(self, bus: Bus, registry: Registry, ns: str, iid: str, labels: dict[str, str] | None = None,
                 role: Role = Role.WORKER):
        self.bus, self.registry, self.ns, self.iid, self.role = bus, registry, ns, iid, role
        self.labels = LAYOUT if labels is None else labels
        self.cache = KVCache(CFG)
        self.epoch = uuid.uuid4().hex
        self.last_id = -1  # the last event id sent (or lost on purpose)
        self.serial = 0
        self.reg = None
        self.sub = None

    async def start(self) -> CacheWorker:
        self.sub = await self.bus.serve(subjects.kv_snapshot(self.ns, self.iid), KVSnapshotRequest, self._snapshot)
        self.reg = self.registry.register(RegistryEntry(role=self.role, instance_id=self.iid, labels=self.labels,
                                                        address=f"tcp://{self.iid}:1", started_at=time.time()), TTL)
        await self.reg.start()
        return self

    async def stop(self, deregister: bool = True) -> None:
        if self.sub is not None:
            await self.sub.unsubscribe()
            self.sub = None
        if self.reg is not None:
            await self.reg.stop(deregister=deregister)
            self.reg = None

    async def _snapshot(self, _: KVSnapshotRequest) -> KVSnapshotReply:
        pending, snap = take_snapshot(self.cache, self.last_id)
        await self._send(pending)
        return KVSnapshotReply(instance_id=self.iid, epoch=self.epoch, last_event_id=snap.last_event_id,
                               block_hashes=list(snap.block_hashes), states=list(snap.states))

    def run(self, tokens: list[int], out: int = 3) -> None:
        """One whole request on the cache: match, admit, prefill, decode `out` tokens, finish."""
        hashes = block_hashes(tokens, P)
        hit = self.cache.match(tokens, hashes)
        self.serial += 1
        sid = f"{self.iid}-{self.serial}"
        assert self.cache.admit(sid, tokens, hit, out, hashes).ok
        done = hit.tokens
        while done < len(tokens):  # prefill in chunks of two pages (the SWA pool is small)
            k = min(2 * P - done % P, len(tokens) - done)
            assert self.cache.reserve(sid, k)
            done += k
            self.cache.commit(sid, k, [60_000 + self.serial] if done == len(tokens) else [])
        for i in range(1, out):
            assert self.cache.reserve(sid, 1)
            self.cache.commit(sid, 1, [60_000 + self.serial + i])
        self.cache.finish(sid)

    def hit(self, tokens: list[int], rebuild: bool = True) -> int:
        h = self.cache.match(tokens, block_hashes(tokens, P), rebuild=rebuild)
        self.cache.release_hit(h)
        return h.tokens

    async def publish(self, lose: bool = False) -> None:
        """Send the pending events (`lose`: drop them, as a lossy bus would: the router sees a gap)."""
        events = self.cache.drain_events()
        if lose:
            self.last_id = events[-1].event_id if events else self.last_id
            return
        await self._send(events)

    async def _send(self, events: list[KVEvent]) -> None:
        for i in range(0, len(events), 64):  # bounded batches
            part = events[i:i + 64]
            await self.bus.publish(subjects.kv_events(self.ns, self.iid),
                                   KVEventBatch(instance_id=self.iid, epoch=self.epoch,
                                                events=[wire_event(e) for e in part]))
            self.last_id = part[-1].event_id




def synced(router: RouterService, workers: list[CacheWorker]) -> bool:
    """Every worker's view in the router is in step with the last event it sent."""
    idx = router.sync.index
    return idx is not None and all(w.iid in router.sync.members and not idx.is_stale(w.iid)
                                   and idx.next_event_id(w.iid) == w.last_id + 1 for w in workers)


async def shutdown(routers: list[RouterService], workers: list[CacheWorker]) -> None:
    for r in routers:
        await r.stop()
    for w in workers:
        await w.stop()


async def start_router(nats_url: str, ns: str, iid: str, **kw) -> RouterService:
    router = RouterService(RouterConfig(nats_url=nats_url, namespace=ns, instance_id=iid, **kw))
    await router.start()
    return router


async def route(bus: Bus, ns: str, rid: str, tokens: list[int], exclude: list[str] | None = None) -> RouteReply:
    req = RouteRequest(request_id=rid, num_tokens=len(tokens), block_hashes=block_hashes(tokens, P),
                       exclude_instances=exclude or [])
    return await bus.request(subjects.route(ns), req, RouteReply, 10)


def conversations(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts sharing system prompts (3) and users' earlier turns: plenty of shared prefixes."""
    systems = [[s * 1000 + i for i in range(12 + 8 * s)] for s in range(3)]
    out = []
    for c in range(n):
        turn = systems[c % 3] + [10_000 + c * 100 + i for i in range(rng.randrange(3, 30))]
        out.append(turn)
        if rng.random() < 0.5:
            out.append(turn + [20_000 + c * 100 + i for i in range(rng.randrange(1, 20))])
    return out


def probes(rng: random.Random, served: list[list[int]], n: int) -> list[list[int]]:
    """Follow-ups of served prompts, cuts of them, and unrelated prompts."""
    out = []
    for _ in range(n):
        base = rng.choice(served)
        kind = rng.randrange(3)
        if kind == 0:
            out.append(base + [30_000 + rng.randrange(1000) for _ in range(rng.randrange(1, 9))])
        elif kind == 1:
            out.append(base[:rng.randrange(1, len(base) + 1)] + [40_000 + rng.randrange(1000)])
        else:
            out.append([50_000 + rng.randrange(10_000) for _ in range(rng.randrange(2, 40))])
    return out


async def check_predictions(bus: Bus, ns: str, workers: list[CacheWorker], prompts: list[list[int]]) -> int:
    """Per prompt and worker, the router's predicted hit (the others excluded) equals that cache's `match`; the
    unrestricted route goes to a worker with the best hit. Returns the prompts with a hit somewhere."""
    ids = [w.iid for w in workers]
    with_hit = 0
    for k, tokens in enumerate(prompts):
        hits = {w.iid: w.hit(tokens) for w in workers}
        for w in workers:
            reply = await route(bus, ns, f"p{k}-{w.iid}", tokens, exclude=[i for i in ids if i != w.iid])
            assert (reply.prefill_instance, reply.predicted_hit_tokens) == (w.iid, hits[w.iid]), (k, tokens)
        best = await route(bus, ns, f"p{k}", tokens)
        assert best.predicted_hit_tokens == max(hits.values()) == hits[best.prefill_instance]
        with_hit += max(hits.values()) > 0
    return with_hit


async def fleet(bus: Bus, ns: str, n: int, seed: int) -> tuple[list[CacheWorker], list[list[int]]]:
    registry = await Registry.open(bus, bucket=subjects.registry_bucket(ns))
    workers = [await CacheWorker(bus, registry, ns, f"w{i}").start() for i in range(n)]
    rng = random.Random(seed)
    served = conversations(rng, 12)
    for k, tokens in enumerate(served):
        workers[k % n].run(tokens)
    return workers, served


async def test_predictions_equal_each_caches_match_and_routes_follow_the_hit(bus, nats_url):
    ns = "rt_predict"
    router = await start_router(nats_url, ns, "r1", queue_weight=0.0)  # no load term: the hit decides
    workers, served = await fleet(bus, ns, 3, seed=1)
    try:
        for w in workers:
            await w.publish()
        await until(lambda: synced(router, workers), what="router in step with the workers' events")
        rng = random.Random(2)
        assert await check_predictions(bus, ns, workers, probes(rng, served, 12)) >= 4
        # more traffic (SWA eviction under the small pool), events only: still exact
        for k, tokens in enumerate(probes(rng, served, 9)):
            workers[k % 3].run(tokens)
        for w in workers:
            await w.publish()
        await until(lambda: synced(router, workers), what="router in step after more events")
        assert await check_predictions(bus, ns, workers, probes(rng, served, 12)) >= 4
        assert router.health_details()["kv_workers"] == "3"
    finally:
        await shutdown([router], workers)


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_event_gap_resyncs_by_snapshot_and_a_restarted_router_rebuilds_from_snapshots(bus, nats_url):
    ns = "rt_resync"
    router = await start_router(nats_url, ns, "r1", queue_weight=0.0)
    workers, served = await fleet(bus, ns, 2, seed=3)
    rng = random.Random(4)
    try:
        for w in workers:
            await w.publish()
        await until(lambda: synced(router, workers), what="initial sync")
        gaps, resyncs = _metric("windserve_router_event_gaps_total"), _metric(
            "windserve_router_snapshot_resyncs_total", outcome="ok")
        # events lost on the way: the next batch shows a gap, the router asks for a snapshot
        workers[0].run(probes(rng, served, 1)[0])
        await workers[0].publish(lose=True)
        workers[0].run(probes(rng, served, 1)[0])
        await workers[0].publish()
        await until(lambda: synced(router, workers), what="resync after the gap")
        assert _metric("windserve_router_event_gaps_total") == gaps + 1
        assert _metric("windserve_router_snapshot_resyncs_total", outcome="ok") >= resyncs + 1
        await check_predictions(bus, ns, workers, probes(rng, served, 8))

        # the router goes away; the workers go on (their events reach nobody); a new router starts late
        await router.stop()
        for k, tokens in enumerate(probes(rng, served, 6)):
            workers[k % 2].run(tokens)
        for w in workers:
            await w.publish()
        router = await start_router(nats_url, ns, "r2", queue_weight=0.0)
        await until(lambda: synced(router, workers), what="restarted router rebuilt from snapshots")
        assert await check_predictions(bus, ns, workers, probes(rng, served, 10)) >= 3

        # a worker restarts under the same id (new process: new epoch, empty cache, ids from 0 again)
        w = workers[1]
        w.cache, w.epoch, w.last_id = KVCache(CFG), uuid.uuid4().hex, -1
        w.run(served[1])
        await w.publish()
        await until(lambda: synced(router, workers), what="the new epoch replaces the old view")
        assert _metric("windserve_router_kv_event_batches_total", outcome="new_epoch") >= 1
        await check_predictions(bus, ns, workers, probes(rng, served, 8))
    finally:
        await shutdown([router], workers)


async def test_a_worker_that_stops_heartbeating_leaves_the_index_and_routing_within_ttl(bus, nats_url):
    ns = "rt_leave"
    router = await start_router(nats_url, ns, "r1")
    workers, _ = await fleet(bus, ns, 2, seed=5)
    registry = await Registry.open(bus, bucket=subjects.registry_bucket(ns))
    odd = CacheWorker(bus, registry, ns, "odd", labels={**LAYOUT, "kv_page_size": "16"})  # another layout
    bare = CacheWorker(bus, registry, ns, "bare", labels={})  # no layout: routed, not indexed
    await odd.start()
    await bare.start()
    try:
        for w in workers:
            await w.publish()
        await until(lambda: synced(router, workers), what="initial sync")
        assert set(router.sync.members) == {"w0", "w1"}  # "odd" refused, "bare" advertises none
        assert (await route(bus, ns, "b", [1, 2, 3], exclude=["w0", "w1", "odd"])).prefill_instance == "bare"

        await workers[0].stop(deregister=False)  # as if SIGKILLed: no deregistration, heartbeats stop
        gone = time.monotonic()
        await until(lambda: "w0" not in router.sync.members, timeout=TTL.ttl_s + 10, what="w0 leaves the index")
        assert time.monotonic() - gone < TTL.ttl_s + 10
        assert "w0" not in router.sync.index.workers  # type: ignore[union-attr]
        with pytest.raises(RemoteError, match=r"no worker for request x: .*besides"):
            await route(bus, ns, "x", [1, 2, 3], exclude=["w1", "odd", "bare"])
        picks = {(await route(bus, ns, f"q{i}", [7] * 9)).prefill_instance for i in range(8)}
        assert "w0" not in picks
    finally:
        await shutdown([router], [*workers, odd, bare])


async def test_two_routers_agree_and_a_burst_split_over_them_spreads(bus, nats_url):
    ns = "rt_replicas"
    routers = [await start_router(nats_url, ns, f"r{i}") for i in range(2)]
    workers, served = await fleet(bus, ns, 4, seed=6)
    try:
        for w in workers:
            await w.publish()
        await until(lambda: all(synced(r, workers) for r in routers), what="both routers in sync")
        # a burst of identical-cost requests (no cached prefix anywhere), alternating between the replicas: each
        # counts the other's picks, so the burst spreads over the four workers (alone: w1, w1, w2, w3)
        picks = []
        for i in range(4):
            mine, other = routers[i % 2], routers[1 - i % 2]
            seen = other.remote_picks
            reply = await mine.route(RouteRequest(request_id=f"burst{i}", num_tokens=64))
            await until(lambda: other.remote_picks > seen, what="the pick reached the other replica")  # noqa: B023
            picks.append(reply.prefill_instance)
        assert sorted(picks) == ["w0", "w1", "w2", "w3"]
        # the same requests get the same answers from either replica
        rng = random.Random(7)
        for k, tokens in enumerate(probes(rng, served, 10)):
            req = RouteRequest(request_id=f"same{k}", num_tokens=len(tokens), block_hashes=block_hashes(tokens, P))
            seen = routers[1].remote_picks
            first = await routers[0].route(req)
            await until(lambda: routers[1].remote_picks > seen, what="pick shared")  # noqa: B023
            assert await routers[1].route(req) == first
        # each replica answers on its own subject too (the gateway asks a named router when one is silent)
        for i, router in enumerate(routers):
            other = routers[1 - i]
            seen = other.remote_picks
            await bus.request(subjects.router_route(ns, router.router_id),
                              RouteRequest(request_id=f"named{i}", num_tokens=8), RouteReply, 10)
            await until(lambda: other.remote_picks > seen, what="the named replica answered")  # noqa: B023
    finally:
        await shutdown(routers, workers)


async def disaggregated(bus, nats_url: str, ns: str, n_decodes: int):
    """A router (no queue weight) with one prefill p0 and decodes d0..d{n-1}, all cache-backed workers."""
    router = await start_router(nats_url, ns, "r1", queue_weight=0.0)
    registry = await Registry.open(bus, bucket=subjects.registry_bucket(ns))
    prefill = await CacheWorker(bus, registry, ns, "p0", role=Role.PREFILL).start()
    decodes = [await CacheWorker(bus, registry, ns, f"d{i}", role=Role.DECODE).start() for i in range(n_decodes)]
    return router, prefill, decodes


async def test_disaggregated_routes_predict_the_decode_side_hit_too(bus, nats_url):
    ns = "rt_disagg"
    router, prefill, decodes = await disaggregated(bus, nats_url, ns, 2)
    workers = [prefill, *decodes]
    try:
        served = conversations(random.Random(10), 4)
        for tokens in served:
            prefill.run(tokens)
        decodes[1].run(served[-1])  # d1 received this conversation's KV before
        for w in workers:
            await w.publish()
        await until(lambda: synced(router, workers), what="sync")
        tokens = served[-1] + [5, 6, 7, 8, 9]
        reply = await route(bus, ns, "dg", tokens)
        assert (reply.prefill_instance, reply.decode_instance) == ("p0", "d1")
        assert reply.predicted_hit_tokens == prefill.hit(tokens) > 0
        assert reply.predicted_decode_hit_tokens == decodes[1].hit(tokens, rebuild=False) > 0
    finally:
        await shutdown([router], workers)


async def test_a_prefills_decode_re_ask_with_its_chain_goes_where_the_kv_is(bus, nats_url):
    ns = "rt_reask"
    router, prefill, decodes = await disaggregated(bus, nats_url, ns, 3)
    workers = [prefill, *decodes]
    try:
        served = conversations(random.Random(14), 3)
        decodes[2].run(served[-1])  # d2 holds this conversation; d0 will refuse (full)
        for w in workers:
            await w.publish()
        await until(lambda: synced(router, workers), what="sync")
        tokens = served[-1] + [5, 6, 7, 8, 9]
        # the re-ask as the prefill sends it (services/prefill/service.py `_reroute`): the chain goes along
        reask = RouteRequest(request_id="ra", num_tokens=len(tokens), block_hashes=block_hashes(tokens, P),
                             exclude_decodes=["d0"])
        reply = await bus.request(subjects.route(ns), reask, RouteReply, 10)
        assert reply.decode_instance == "d2"
        assert reply.predicted_decode_hit_tokens == decodes[2].hit(tokens, rebuild=False) > 0
    finally:
        await shutdown([router], workers)


async def test_hit_reports_feed_the_predicted_and_actual_metrics(bus, nats_url):
    ns = "rt_feedback"
    router = await start_router(nats_url, ns, "r1")
    workers, served = await fleet(bus, ns, 1, seed=8)
    try:
        await workers[0].publish()
        await until(lambda: synced(router, workers), what="sync")
        tokens = served[-1] + [99, 98, 97, 96, 95]
        reply = await route(bus, ns, "fb1", tokens)
        assert reply.predicted_hit_tokens == workers[0].hit(tokens) > P
        before = {m: _metric(f"windserve_router_{m}_total", side="prefill")
                  for m in ("predicted_hit_tokens", "actual_hit_tokens", "mispredicted_tokens")}
        unmatched = _metric("windserve_router_hit_reports_total", outcome="unmatched")
        actual = reply.predicted_hit_tokens - P  # the worker got one page less than predicted
        for rid in ("fb1", "someone-elses"):
            await bus.publish(subjects.kv_hits(ns), KVHitReport(request_id=rid, instance_id="w0",
                                                                prompt_tokens=len(tokens), cached_tokens=actual))
        await until(lambda: router.hit_reports >= 2, what="hit reports received")
        got = {m: _metric(f"windserve_router_{m}_total", side="prefill") - v for m, v in before.items()}
        assert got == {"predicted_hit_tokens": reply.predicted_hit_tokens, "actual_hit_tokens": actual,
                       "mispredicted_tokens": P}
        assert _metric("windserve_router_hit_reports_total", outcome="unmatched") == unmatched + 1
        assert _metric("windserve_router_decisions_total", policy="affinity", outcome="ok") >= 1
    finally:
        await shutdown([router], workers)


async def test_approximate_mode_predicts_from_its_own_decisions(bus, nats_url):
    ns = "rt_approx"
    router = await start_router(nats_url, ns, "r1", kv_index=False)
    workers, _ = await fleet(bus, ns, 3, seed=9)
    try:
        await until(lambda: len(router.sync.members) == 3, what="workers joined")
        assert router.sync.index is None and router.health_details()["kv_events"] == "approximate"
        prompt = list(range(41))
        first = await route(bus, ns, "a1", prompt)
        assert first.predicted_hit_tokens == 0
        again = await route(bus, ns, "a2", prompt + [7, 7, 7, 7, 7])  # a follow-up: same worker, predicted hit
        assert (again.prefill_instance, again.predicted_hit_tokens) == (first.prefill_instance, 40)
    finally:
        await shutdown([router], workers)


async def test_approximate_replicas_share_their_decisions(bus, nats_url):
    ns = "rt_approx_replicas"
    routers = [await start_router(nats_url, ns, f"r{i}", kv_index=False) for i in range(2)]
    workers, _ = await fleet(bus, ns, 3, seed=13)
    try:
        await until(lambda: all(len(r.sync.members) == 3 for r in routers), what="workers joined both")
        prompt = list(range(41))
        first = await routers[0].route(RouteRequest(request_id="s1", num_tokens=len(prompt),
                                                    block_hashes=block_hashes(prompt, P)))
        await until(lambda: routers[1].remote_picks >= 1, what="the pick reached the other replica")
        follow = prompt + [7, 7, 7, 7, 7]  # the next turn, answered by the replica that did not route the first
        again = await routers[1].route(RouteRequest(request_id="s2", num_tokens=len(follow),
                                                    block_hashes=block_hashes(follow, P)))
        assert (again.prefill_instance, again.predicted_hit_tokens) == (first.prefill_instance, 40)
    finally:
        await shutdown(routers, workers)


async def test_least_loaded_policy_still_reports_the_hits_of_its_picks(bus, nats_url):
    ns = "rt_least"
    router = await start_router(nats_url, ns, "r1", policy="least_loaded")
    workers, served = await fleet(bus, ns, 2, seed=11)
    try:
        for w in workers:
            await w.publish()
        await until(lambda: synced(router, workers), what="sync")
        for k, tokens in enumerate(probes(random.Random(12), served, 6)):
            reply = await route(bus, ns, f"l{k}", tokens)
            picked = next(w for w in workers if w.iid == reply.prefill_instance)
            assert reply.predicted_hit_tokens == picked.hit(tokens)
        assert _metric("windserve_router_decisions_total", policy="least_loaded", outcome="ok") >= 6
    finally:
        await shutdown([router], workers)
