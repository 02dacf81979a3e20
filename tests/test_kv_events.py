"""The KV-affinity feed of the engine workers (libs/worker/kv_events.py, kv_wire.py): cache events on the bus,
snapshots, layout labels and hit reports, checked against the worker's own `KVCache.match`.

Pure parts first (bit meanings, wire round trip, batching, the cache's snapshot after dropped events, the
feed's backpressure), then in-process services with the tiny model against a real nats-server.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import types
import uuid
from pathlib import Path

import pytest

from libs.bus import Bus, BusTimeout, NoResponders, RemoteError
from libs.kvcache import (
    BlockHeld,
    CacheSnapshot,
    EventKind,
    KVCache,
    KVCacheConfig,
    KVEvent,
    Tier,
    block_hashes,
)
from libs.routing import BlockState, ClusterPrefixIndex, KVSnapshot
from libs.routing.snapshot import take_snapshot
from libs.worker.kv_events import KVFeed
from libs.worker.kv_wire import (
    event_batches,
    kv_event,
    kv_events,
    routing_snapshot,
    runs,
    snapshot_reply,
    wire_event,
)
from protos import subjects
from protos.messages import (
    KV_LAYOUT_LABELS,
    KVEventBatch,
    KVHitReport,
    KVSnapshotReply,
    KVSnapshotRequest,
    Role,
)
from services.decode.config import DecodeConfig
from services.decode.service import DecodeService
from services.prefill.config import PrefillConfig
from services.prefill.service import PrefillService
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from tests.test_worker import (
    ask_generate,
    assert_engine_at_baseline,
    generate_request,
    prompt,
    service_config,
    started,
    stream,
    tcp_transfer,  # noqa: F401 (fixture)
)


# ------------------------------------------------------------------------------------------ pure parts
def test_cache_snapshot_bits_are_the_routing_index_bits():
    assert {b.name: int(b) for b in BlockHeld} == {b.name: int(b) for b in BlockState}


def test_the_wire_conversions_import_no_torch():
    """A router imports `libs.worker.kv_wire` without the engine stack."""
    code = "import sys, libs.worker.kv_wire; print('torch' in sys.modules, 'libs.engine' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.split() == ["False", "False"]


def test_wire_events_round_trip():
    evs = [KVEvent(0, EventKind.STORED, Tier.DEVICE, (1, 2**64 - 1, 3), None, (False, True, True), (True, False, True)),
           KVEvent(1, EventKind.STORED, Tier.HOST, (7,), 3, (True,), (True,)),
           KVEvent(2, EventKind.SWA_REMOVED, Tier.DEVICE, (1, 2), None, (False, False), (False, False)),
           KVEvent(3, EventKind.REMOVED, Tier.HOST, (7,), 3)]
    assert [kv_event(wire_event(e)) for e in evs] == evs
    (batch,) = event_batches("w", "e", evs)
    assert kv_events(KVEventBatch.model_validate_json(batch.model_dump_json())) == evs


def test_batches_are_bounded_and_cut_at_id_gaps():
    def ev(i: int, n: int) -> KVEvent:
        return KVEvent(i, EventKind.STORED, Tier.DEVICE, tuple(range(n)), None)

    evs = [ev(0, 3), ev(1, 3), ev(2, 5), ev(5, 1), ev(6, 1), ev(7, 9)]
    assert [[e.event_id for e in r] for r in runs(evs, max_blocks=6)] == [[0, 1], [2], [5, 6], [7]]
    batches = event_batches("w", "e", evs, max_blocks=6)
    assert [b.events[0].event_id for b in batches] == [0, 2, 5, 7]  # each batch validates: consecutive ids


CFG = KVCacheConfig(page_size=4, window=8, num_full_pages=64, num_swa_pages=32)


def _serve(cache: KVCache, sid: str, tokens: list[int]) -> None:
    """One request through the cache protocol (match, admit, compute all, finish)."""
    hit = cache.match(tokens)
    assert cache.admit(sid, tokens, hit, 1).ok
    assert cache.reserve(sid, len(tokens) - hit.tokens)
    cache.commit(sid, len(tokens) - hit.tokens)
    cache.finish(sid)


def test_snapshot_after_dropped_events_resyncs_the_index():
    """The cache's bounded queue dropped events: the drained ids start late (the gap is visible), and the
    snapshot, consistent with the last id the cache issued, brings a fresh index to what a fully fed one has."""
    full = ClusterPrefixIndex(CFG.page_size, CFG.window)
    small = KVCache(KVCacheConfig(**{**CFG.__dict__, "max_pending_events": 2}))
    ref = KVCache(CFG)
    for i in range(4):
        tokens = prompt(10 + i, 18)
        _serve(small, f"s{i}", tokens)
        _serve(ref, f"s{i}", tokens)
        assert full.apply("w", ref.drain_events())
    index = ClusterPrefixIndex(CFG.page_size, CFG.window)
    dropped = small.drain_events()
    assert dropped and dropped[0].event_id > 0 and not index.apply("w", dropped)
    assert index.stale_workers() == ["w"]
    _serve(small, "late", prompt(20, 13))  # after the gap: buffered by the stale view
    assert not index.apply("w", small.drain_events())
    _serve(small, "later", prompt(21, 10))  # pending when the snapshot is taken: drained by it
    pending, snap = small.snapshot()
    assert pending and snap.last_event_id == pending[-1].event_id == small.events.last_id
    assert len(snap.block_hashes) == len(snap.states) > 0
    assert index.load_snapshot("w", routing_snapshot_of(snap)) and not index.is_stale("w")
    assert index.next_event_id("w") == snap.last_event_id + 1
    for sid, n, tokens in (("late", 20, 13), ("later", 21, 10)):
        _serve(ref, sid, prompt(n, tokens))
    assert full.apply("w", ref.drain_events())
    assert index.blocks_of("w") == full.blocks_of("w")
    # the routing wrapper agrees with the cache's own snapshot
    _, wrapped = take_snapshot(small)
    assert (wrapped.last_event_id, wrapped.block_hashes, wrapped.states) == (
        snap.last_event_id, snap.block_hashes, snap.states)


def routing_snapshot_of(snap: CacheSnapshot) -> KVSnapshot:
    """`snap` through the wire, as a router loads it."""
    return routing_snapshot(KVSnapshotReply.model_validate_json(snapshot_reply("w", "e", snap).model_dump_json()))


async def test_feed_stops_draining_while_the_bus_lags_so_the_cache_drops_and_the_gap_shows():
    cache = KVCache(KVCacheConfig(**{**CFG.__dict__, "max_pending_events": 3}))
    core = types.SimpleNamespace(cache=cache, drain_admissions=lambda: [])
    sent: list[KVEventBatch] = []

    async def publish(subject, msg):
        sent.append(msg)

    feed = KVFeed(types.SimpleNamespace(), publish, "ns", "w", hits=False, max_queued=1)  # type: ignore[arg-type]
    feed._loop = asyncio.get_running_loop()
    _serve(cache, "a", prompt(1, 9))
    feed.on_step(core, True)  # drained: the backlog is now over max_queued until the loop publishes
    for i in range(4):
        _serve(cache, f"b{i}", prompt(2 + i, 9))
        feed.on_step(core, True)  # not drained: the cache's bounded queue drops the oldest
    await asyncio.sleep(0)
    await feed.flush()
    feed.on_step(core, True)
    await asyncio.sleep(0)
    await feed.flush()
    ids = [e.event_id for b in sent for e in b.events]
    assert ids[0] == 0 and ids[-1] == cache.events.last_id
    assert any(b - a > 1 for a, b in zip(ids, ids[1:], strict=False))  # the gap stays visible
    assert ids == sorted(ids)


class _InlineEngine:
    """Runs `call`s at once on the test's thread (the feed's engine side without a step loop)."""

    def __init__(self, core) -> None:
        self.core = core

    async def call(self, fn, timeout_s=None):
        return fn(self.core)


async def test_snapshot_reply_follows_the_events_it_drained():
    cache = KVCache(CFG)
    core = types.SimpleNamespace(cache=cache, drain_admissions=lambda: [])
    sent: list = []

    async def publish(subject, msg):
        sent.append(msg)

    feed = KVFeed(_InlineEngine(core), publish, "ns", "w", hits=False)  # type: ignore[arg-type]
    feed._loop = asyncio.get_running_loop()
    _serve(cache, "a", prompt(1, 9))
    feed.on_step(core, True)
    _serve(cache, "b", prompt(2, 13))  # pending, not drained by the hook
    reply = await feed.answer_snapshot(KVSnapshotRequest())
    ids = [e.event_id for b in sent for e in b.events]
    assert ids == list(range(reply.last_event_id + 1)) and reply.last_event_id == cache.events.last_id
    assert reply.epoch == feed.epoch == sent[0].epoch and cache.pending_events() == 0


# ------------------------------------------------------------------------------------------ services
class Feed:
    """A router's view of one worker: KVEventBatches and hit reports as they arrive, an index fed from them
    (optionally skipping the first `skip` batches, an event gap), resynced by snapshot when stale."""

    def __init__(self, bus: Bus, svc, skip: int = 0) -> None:
        self.bus, self.svc, self.skip = bus, svc, skip
        labels = svc.registry_entry().labels
        self.page, window, rebuild, self.seed = (int(labels[k]) for k in KV_LAYOUT_LABELS)
        self.index = ClusterPrefixIndex(self.page, window, rebuild)
        self.batches: list[KVEventBatch] = []
        self.hits: list[KVHitReport] = []
        self.fed = 0  # batches taken into the index (or skipped)
        self.gaps = 0

    async def start(self) -> Feed:
        ns, iid = self.svc.config.namespace, self.svc.config.instance_id
        self.events_sub = await self.bus.subscribe(subjects.kv_events(ns, iid), KVEventBatch)
        self.hits_sub = await self.bus.subscribe(subjects.kv_hits(ns), KVHitReport)
        return self

    async def pump(self, timeout: float = 0.3) -> None:
        """Take what has arrived (waiting up to `timeout` for each next message) into the index."""
        for sub, sink in ((self.events_sub, self.batches), (self.hits_sub, self.hits)):
            while True:
                try:
                    sink.append(await sub.next(timeout))
                except BusTimeout:
                    break
        for batch in self.batches[self.fed:]:
            self.fed += 1
            if self.skip > 0:
                self.skip -= 1
                continue
            if not self.index.apply(batch.instance_id, kv_events(batch)):
                self.gaps += 1
        if self.index.stale_workers():
            reply = await self.bus.request(subjects.kv_snapshot(self.svc.config.namespace,
                                                                self.svc.config.instance_id),
                                           KVSnapshotRequest(router_id="test"), KVSnapshotReply, 10)
            self.index.load_snapshot(reply.instance_id, routing_snapshot(reply))

    async def settle(self) -> None:
        """Until the index has every event the worker's cache issued (the engine is idle)."""
        cache = self.svc.engine.core.cache
        async with asyncio.timeout(20):
            while True:
                await self.pump()
                last = await self.svc.engine.call(lambda core: core.cache.events.last_id, timeout_s=10)
                if self.index.next_event_id(self.svc.config.instance_id) == last + 1 and not cache.pending_events():
                    return

    def predicted(self, tokens: list[int], rebuild: bool = True) -> int:
        chain = block_hashes(tokens, self.page, self.seed)
        hit = self.index.predict(chain, len(tokens), rebuild).get(self.svc.config.instance_id)
        return 0 if hit is None else hit.tokens

    def assert_gapless(self) -> None:
        ids = [e.event_id for b in self.batches for e in b.events]
        assert ids == list(range(len(ids))) and len({b.epoch for b in self.batches}) == 1 and self.gaps == 0


async def worker_matches(svc, prompts: list[list[int]], rebuild: bool = True) -> list[int]:
    """What the worker's own cache.match returns for each prompt (each hit released at once)."""
    def run(core) -> list[int]:
        out = []
        for p in prompts:
            hit = core.cache.match(p, rebuild=rebuild)
            out.append(hit.tokens)
            core.cache.release_hit(hit)
        return out
    return await svc.engine.call(run, timeout_s=10)


async def serve(bus: Bus, svc, rid: str, tokens: list[int], max_tokens: int = 4, decode: str = ""):
    ns = svc.config.namespace
    reader = await stream(bus, ns, rid)
    ack = await ask_generate(bus, svc, generate_request(ns, rid, tokens, max_tokens, decode_instance=decode))
    assert ack.status.value == "accepted", ack
    final = await reader.final()
    await reader.sub.unsubscribe()
    return final, [t for c in reader.chunks for t in c.token_ids]


def conversation() -> tuple[list[list[int]], list[list[int]]]:
    """Served prompts (a shared system prefix, follow-ups that extend earlier turns) and unseen probes."""
    system = prompt(100, 24)
    a = system + prompt(101, 13)
    b = system + prompt(102, 18)
    probes = [system + prompt(200, 9), a + prompt(201, 7), prompt(202, 30), b[:29], system[:11]]
    return [a, b], probes


@pytest.mark.integration
async def test_worker_events_predict_its_own_match_and_hits_come_back(bus, nats_url):
    svc = await started(WorkerService(service_config(WorkerConfig, nats_url)))
    try:
        feed = await Feed(bus, svc).start()
        served, probes = conversation()
        entry = next(e for e in await svc.registry.list(Role.WORKER) if e.instance_id == svc.config.instance_id)
        cache_cfg = svc.engine.core.cache.cfg
        assert {k: entry.labels[k] for k in KV_LAYOUT_LABELS} == {
            "kv_page_size": str(cache_cfg.page_size), "kv_window": str(cache_cfg.window),
            "kv_rebuild_tokens": str(cache_cfg.rebuild_tokens), "kv_hash_seed": str(cache_cfg.hash_seed)}
        outputs, cached = [], {}
        for i, p in enumerate(served):
            final, out = await serve(bus, svc, f"r{i}", p)
            outputs.append(out)
            cached[f"r{i}"] = final.usage.cached_tokens
        await feed.settle()
        # follow-up turns: the prediction from the events is the hit the worker reports (usage and kv_hits)
        follow = [served[0] + outputs[0] + prompt(300, 6), served[1] + outputs[1][:2]]
        for i, p in enumerate(follow):
            predicted = feed.predicted(p)
            final, _ = await serve(bus, svc, f"f{i}", p)
            assert predicted > 0 and final.usage.cached_tokens == predicted
            cached[f"f{i}"] = predicted
            await feed.settle()
        all_prompts = served + follow + probes
        assert [feed.predicted(p) for p in all_prompts] == await worker_matches(svc, all_prompts)
        feed.assert_gapless()  # one epoch, ids from 0 without a gap
        ids = [e.event_id for b in feed.batches for e in b.events]
        assert all(sum(len(e.block_hashes) for e in b.events) <= 1024 or len(b.events) == 1 for b in feed.batches)
        hits = {h.request_id: h for h in feed.hits}
        assert {rid: h.cached_tokens for rid, h in hits.items()} == cached  # one report each, usage's figure
        assert hits["f0"].prompt_tokens == len(follow[0]) and hits["f0"].instance_id == svc.config.instance_id
        # a late router: the snapshot alone gives the same view and the same predictions
        reply = await bus.request(subjects.kv_snapshot(svc.config.namespace, svc.config.instance_id),
                                  KVSnapshotRequest(), KVSnapshotReply, 10)
        late = ClusterPrefixIndex(feed.page, int(entry.labels["kv_window"]), int(entry.labels["kv_rebuild_tokens"]))
        assert reply.epoch == feed.batches[0].epoch and reply.last_event_id == ids[-1]
        assert late.load_snapshot(reply.instance_id, routing_snapshot(reply))
        assert late.blocks_of(reply.instance_id) == feed.index.blocks_of(reply.instance_id)
        await assert_engine_at_baseline(svc)
    finally:
        await svc.stop()


@pytest.mark.integration
async def test_an_event_gap_is_resynced_by_snapshot(bus, nats_url):
    svc = await started(WorkerService(service_config(WorkerConfig, nats_url)))
    try:
        feed = await Feed(bus, svc, skip=1).start()
        served, probes = conversation()
        await serve(bus, svc, "g0", served[0])
        await feed.pump()  # its batch is skipped: nothing of it is known yet
        assert feed.fed >= 1 and not feed.index.workers
        await serve(bus, svc, "g1", served[1])
        await feed.settle()  # the next batch shows the gap: stale, then resynced by a snapshot
        assert feed.gaps >= 1 and not feed.index.stale_workers()
        assert [feed.predicted(p) for p in served + probes] == await worker_matches(svc, served + probes)
        assert max(feed.predicted(p) for p in served + probes) > 0
        await assert_engine_at_baseline(svc)
    finally:
        await svc.stop()


@pytest.mark.integration
async def test_kv_events_off_publishes_no_events_and_answers_no_snapshot(bus, nats_url, monkeypatch):
    monkeypatch.setenv("WINDSERVE_KV_EVENTS", "0")
    from libs.service.config import load_config
    base = service_config(WorkerConfig, nats_url)
    cfg = load_config(WorkerConfig, nats_url=nats_url, namespace=f"off_{uuid.uuid4().hex[:6]}",
                      engine=base.engine)
    assert cfg.kv_events is False
    svc = await started(WorkerService(cfg))
    try:
        events = await bus.subscribe(subjects.kv_events_all(cfg.namespace), KVEventBatch)
        hits = await bus.subscribe(subjects.kv_hits(cfg.namespace), KVHitReport)
        served, _ = conversation()
        await serve(bus, svc, "o0", served[0])
        report = await hits.next(10)  # hit reports are their own switch (kv_hit_reports)
        assert report.request_id == "o0"
        with pytest.raises(BusTimeout):
            await events.next(1.0)
        with pytest.raises((NoResponders, RemoteError, TimeoutError)):
            await bus.request(subjects.kv_snapshot(cfg.namespace, cfg.instance_id), KVSnapshotRequest(),
                              KVSnapshotReply, 2)
        # nobody drained the cache's events: they wait (bounded) in its queue
        assert await svc.engine.call(lambda core: core.cache.pending_events(), timeout_s=10) > 0
        await assert_engine_at_baseline(svc)
    finally:
        await svc.stop()


@pytest.mark.integration
@pytest.mark.usefixtures("tcp_transfer")
async def test_prefill_and_decode_publish_their_events_and_their_own_hits(bus, nats_url):
    ns = f"pd_{uuid.uuid4().hex[:6]}"
    decode = await started(DecodeService(service_config(DecodeConfig, nats_url, namespace=ns)))
    prefill = await started(PrefillService(service_config(PrefillConfig, nats_url, namespace=ns)))
    try:
        feeds = {svc: await Feed(bus, svc).start() for svc in (prefill, decode)}
        did = decode.config.instance_id
        served, probes = conversation()
        _, out = await serve(bus, prefill, "d0", served[0], decode=did)
        for feed in feeds.values():
            await feed.settle()
        follow = served[0] + out + prompt(400, 5)
        want = {prefill.config.instance_id: feeds[prefill].predicted(follow),
                did: feeds[decode].predicted(follow, rebuild=False)}  # decode takes no rebuild hit
        assert want[did] > 0  # decode cached the whole first turn (prompt + output)
        await serve(bus, prefill, "d1", follow, decode=did)
        for feed in feeds.values():
            await feed.settle()
        reports = {(h.request_id, h.instance_id): h.cached_tokens for h in feeds[prefill].hits}
        assert {iid: reports[("d1", iid)] for iid in want} == want
        assert set(reports) == {(rid, iid) for rid in ("d0", "d1") for iid in want}
        prompts = [*served, follow, *probes]
        for svc, rebuild in ((prefill, True), (decode, False)):
            feeds[svc].assert_gapless()
            assert [feeds[svc].predicted(p, rebuild) for p in prompts] == await worker_matches(svc, prompts, rebuild)
            await assert_engine_at_baseline(svc)
    finally:
        await prefill.stop()
        await decode.stop()
