"""libs/routing's prefix index: fed by real `KVCache` events, it predicts each cache's `match` exactly.

The property test runs several small caches (page 4, window 8) under random interleavings of requests
(match / admit / reserve / commit / finish / abort, shared stems, multi-turn follow-ups, branches), eviction
and tombstoning under memory pressure, host backup and host loads; after every operation their events feed
one index, and before every `match` the index's prediction for that worker must equal what `match` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from libs.kvcache import EventKind, KVCache, KVCacheConfig, KVEvent, PrefixHit, Tier, block_hashes
from libs.routing.index import (
    NO_HIT,
    BlockState,
    ClusterPrefixIndex,
    KVSnapshot,
    PredictedHit,
    held_from_flags,
)
from libs.routing.snapshot import take_snapshot

pytestmark = pytest.mark.unit

P, WINDOW = 4, 8

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

CONFIGS = st.builds(
    lambda host, **kw: KVCacheConfig(page_size=P, window=WINDOW, num_host_full_pages=host,
                                     num_host_swa_pages=host // 2, **kw),
    host=st.sampled_from([0, 24, 40]),
    num_full_pages=st.integers(14, 32),
    num_swa_pages=st.integers(6, 16),
    retention=st.sampled_from(["checkpoints", "checkpoints", "none", "all"]),
    checkpoint_align=st.sampled_from([0, 8]),
    checkpoint_every_pages=st.sampled_from([0, 0, 3]),
    rebuild_tokens=st.sampled_from([0, 12, 16]),  # (S == window trips check_invariants: see the report)
)

OPS = st.lists(st.tuples(st.sampled_from(["start", "turn", "turn", "branch", "serve", "serve", "step", "run",
                                          "finish", "abort", "backup", "backup", "backup", "probe"]),
                         st.integers(0, 1), st.integers(0, 1 << 16)), min_size=10, max_size=100)


@dataclass
class _Req:
    prompt: list[int]
    output: list[int]
    done: int = 0
    known: int = 0


@dataclass
class _Worker:
    name: str
    cache: KVCache
    running: dict[str, _Req] = field(default_factory=dict)
    history: list[list[int]] = field(default_factory=list)


def _prompt(r: int, history: list[list[int]], op: str) -> list[int]:
    if op == "turn" and history:  # a follow-up: the whole earlier prompt + output, then a new message
        return history[r % len(history)] + [70_000 + r % 11 * 10 + i for i in range(1 + r % 7)]
    if op == "branch" and history:  # leaves an earlier sequence at a page boundary (full KV, maybe no SWA)
        prev = history[r % len(history)]
        cut = (r >> 3) % (len(prev) // P + 1) * P
        return prev[:cut] + [80_000 + r % 13 * 10 + i for i in range(1 + r % 5)]
    family, stem, tail = r % 3, (r >> 2) % 4, (r >> 4) % 5
    return [family * 1000 + i for i in range(8 + 8 * stem)] + [50_000 + r % 97 * 100 + i for i in range(1 + 4 * tail)]


def _check(index: ClusterPrefixIndex, w: _Worker, tokens: list[int], hashes: list[int], hit: PrefixHit,
           cands: list[PredictedHit], stats: dict[str, int]) -> None:
    got = PredictedHit(hit.tokens, hit.full_tokens, hit.raw_tokens, hit.host_tokens)
    if got == cands[0]:
        stats["exact"] += 1
        return
    # `match` refused the preferred hit: locking / loading it needs more memory than running sequences leave
    # (live load the events do not carry); it must then have fallen back along the predicted order
    u = w.cache.usage()
    avail = min(u.full.free + u.full.cached - u.full.reserved, u.swa.free + u.swa.cached - u.swa.reserved)
    assert got in cands, (got, cands)
    assert cands[0].full_tokens // P > avail, (got, cands, avail)
    stats["fallback"] += 1


def _match(index: ClusterPrefixIndex, w: _Worker, tokens: list[int], rebuild: bool, stats: dict[str, int]) -> PrefixHit:
    hashes = block_hashes(tokens, P)
    cands = index.candidates(hashes, len(tokens), rebuild=rebuild).get(w.name, [NO_HIT])
    # the one-walk pair the disaggregated route uses answers the same
    assert index.predict_both(hashes, len(tokens))[0 if rebuild else 1].get(w.name, NO_HIT) == cands[0]
    hit = w.cache.match(tokens, hashes, rebuild=rebuild)
    _check(index, w, tokens, hashes, hit, cands, stats)
    return hit


def _step(w: _Worker, sid: str, chunk: int) -> bool:
    """One chunk of prefill or one page of decode; True when the request has computed everything."""
    req = w.running[sid]
    full = req.prompt + req.output
    end = len(full) - 1
    if req.done >= end:
        return True
    plen = len(req.prompt)
    k = min(chunk if req.done < plen else P, (plen if req.done < plen else end) - req.done)
    if not w.cache.reserve(sid, k):
        k = min(P - req.done % P, end - req.done)
        assert w.cache.reserve(sid, k)
    req.done += k
    new = full[req.known:min(len(full), req.done + 1)] if req.done >= plen else []
    w.cache.commit(sid, k, new)
    req.known += len(new)
    return req.done >= end


def _apply_op(index: ClusterPrefixIndex, w: _Worker, op: str, r: int, serial: list[int], stats: dict[str, int]) -> None:
    cache = w.cache
    if not w.running and op in ("step", "run", "finish", "abort"):
        op = "start"
    if op in ("start", "turn", "branch", "probe", "serve"):
        tokens = _prompt(r, w.history, ("turn", "branch", "start")[r % 3] if op == "serve" else op)
        hit = _match(index, w, tokens, rebuild=bool(r & 1), stats=stats)
        if op == "probe":
            cache.release_hit(hit)
            return
        serial[0] += 1
        sid = f"{w.name}-{serial[0]}"
        out = [90_000 + serial[0] * 16 + i for i in range(1 + r % 10)]
        if cache.admit(sid, tokens, hit, len(out)).ok:
            w.running[sid] = _Req(tokens, out, hit.tokens, len(tokens))
            if op == "serve":  # the whole request at once: the tree fills with what later requests share
                while not _step(w, sid, 2 * P):
                    pass
                _finish(w, sid)
    elif op == "backup":
        cache.backup_to_host(8 + r % 32)
    else:
        sid = sorted(w.running)[r % len(w.running)]
        if op == "abort":
            del w.running[sid]
            cache.abort(sid)
            return
        done = False
        for _ in range(1 if op == "step" else 1 << 10):
            done = _step(w, sid, (1 + r % 3) * P)
            if done or op == "step":
                break
        if op == "finish" or done and r % 2:
            _finish(w, sid)


def _finish(w: _Worker, sid: str) -> None:
    req = w.running.pop(sid)
    w.cache.finish(sid)
    if req.done >= len(req.prompt):
        w.history.append((req.prompt + req.output)[:req.done])


def _feed(index: ClusterPrefixIndex, workers: list[_Worker]) -> None:
    for w in workers:
        assert index.apply(w.name, w.cache.drain_events())


def _probe_all(index: ClusterPrefixIndex, workers: list[_Worker], r: int, stats: dict[str, int]) -> None:
    """Predictions for a random prompt on every worker, checked by `match` there (then released)."""
    for w in workers:
        tokens = _prompt(r, w.history, ("turn", "branch", "start")[r % 3])
        w.cache.release_hit(_match(index, w, tokens, rebuild=bool(r & 2), stats=stats))
        assert index.apply(w.name, w.cache.drain_events())


@SETTINGS
@given(cfg=CONFIGS, ops=OPS)
# A host backup that drops the host copy of a device tombstone (its only SWA KV) must prune it: found by
# this test, kept as a fixed case.
@example(cfg=KVCacheConfig(page_size=P, window=WINDOW, num_full_pages=18, num_swa_pages=9, num_host_full_pages=24,
                           num_host_swa_pages=12, retention="checkpoints", checkpoint_align=8,
                           checkpoint_every_pages=3),
         ops=[("start", 0, 0)] * 5 + [("serve", 1, 0), ("serve", 1, 89), ("backup", 1, 10), ("serve", 1, 11888),
                                      ("backup", 1, 2)])
def test_index_predicts_every_match_exactly(cfg: KVCacheConfig, ops: list[tuple[str, int, int]]):
    index = ClusterPrefixIndex(P, WINDOW, cfg.rebuild_tokens)
    workers = [_Worker(f"w{i}", KVCache(cfg)) for i in range(2)]
    stats = {"exact": 0, "fallback": 0}
    serial = [0]
    for op, wi, r in ops:
        w = workers[wi]
        _apply_op(index, w, op, r, serial, stats)
        w.cache.check_invariants()
        _feed(index, workers)
        if r % 4 == 0:
            _probe_all(index, workers, r >> 2, stats)
    # a late router that loads snapshots predicts the same as the one fed every event
    late = ClusterPrefixIndex(P, WINDOW, cfg.rebuild_tokens)
    for w in workers:
        pending, snap = take_snapshot(w.cache, index.next_event_id(w.name) - 1)
        assert pending == [] and late.load_snapshot(w.name, snap)
        assert late.blocks_of(w.name) == index.blocks_of(w.name)
    for w in workers:
        for sid in list(w.running):
            w.cache.abort(sid)
    assert stats["exact"] >= stats["fallback"]


# ------------------------------------------------------------------------------------------ units


def _stored(eid, hashes, held, tier=Tier.DEVICE, parent=None):
    return KVEvent(eid, EventKind.STORED, tier, tuple(hashes), parent, (), tuple(held))


def _ev(eid, kind, hashes, tier=Tier.DEVICE):
    return KVEvent(eid, kind, tier, tuple(hashes), None, ())


def test_valid_hit_needs_swa_for_the_last_window_and_follows_ancestor_eviction():
    idx = ClusterPrefixIndex(page_size=4, window=8)  # window = 2 pages
    chain = [11, 12, 13, 14, 15]
    assert idx.apply("a", [_stored(0, chain[:3], (False, True, True)), _stored(1, chain[3:], (True, False))])
    # valid ends: pages 3 (SWA on 1, 2) and 4 (2, 3); page 5 lacks SWA on page 4
    assert idx.predict(chain, 21)["a"] == PredictedHit(16, 16, 20, 0)
    assert idx.predict(chain, 14)["a"] == PredictedHit(12, 12, 12, 0)  # < len(prompt), raw page aligned
    assert idx.apply("a", [_ev(2, EventKind.SWA_REMOVED, chain[:3])])  # ancestor's SWA gone: page 4 needs page 3's
    assert idx.predict(chain, 21)["a"] == PredictedHit(0, 0, 20, 0)
    assert idx.predict(chain, 4) == {}  # a prompt of one page never hits


def test_host_only_blocks_count_with_their_host_swa_and_say_so():
    idx = ClusterPrefixIndex(page_size=4, window=8)
    chain = [1, 2, 3, 4]
    idx.apply("a", [_stored(0, chain, (False, False, True, True)),
                    _stored(1, chain[2:], (True, True), tier=Tier.HOST),
                    _ev(2, EventKind.REMOVED, chain[2:])])  # the device copy of pages 2, 3 left: host only
    assert idx.predict(chain, 17)["a"] == PredictedHit(16, 16, 16, 8)


def test_rebuild_hits_are_credited_at_their_recompute_cost():
    idx = ClusterPrefixIndex(page_size=4, window=8, rebuild_tokens=8)
    chain = list(range(100, 110))
    idx.apply("a", [_stored(0, chain, (False,) * 10)])  # full KV for 10 pages, SWA nowhere
    hit = idx.predict(chain, 41)["a"]
    assert (hit.tokens, hit.full_tokens, hit.recompute_tokens) == (32, 40, 8)
    assert idx.predict(chain, 41, rebuild=False)["a"] == PredictedHit(0, 0, 40, 0)


def test_gap_marks_stale_and_snapshot_resyncs_with_buffered_events():
    idx = ClusterPrefixIndex(page_size=4, window=8)
    assert idx.apply("a", [_stored(0, [1, 2], (True, True))])
    assert not idx.apply("a", [_stored(2, [3], (True,), parent=2)])  # event 1 missing
    assert idx.stale_workers() == ["a"] and idx.predict([1, 2, 3], 13) == {}  # stale counts as empty
    assert idx.apply("a", [_ev(3, EventKind.SWA_REMOVED, [3])]) is False  # buffered
    snap = KVSnapshot(2, (1, 2, 3), bytes([3, 3, 3]))  # consistent with events 0..2
    assert idx.load_snapshot("a", snap)
    assert not idx.is_stale("a") and idx.next_event_id("a") == 4
    assert idx.blocks_of("a") == {1: 3, 2: 3, 3: 1}  # event 3 replayed after the snapshot
    assert idx.load_snapshot("a", KVSnapshot(0, (1,), b"\x03"))  # a snapshot replaces the whole view
    assert idx.next_event_id("a") == 1 and idx.blocks_of("a") == {1: 3}
    stale = ClusterPrefixIndex(page_size=4, window=8)
    stale.apply("b", [_stored(5, [1], (True,))])  # a late router: first event is not 0
    assert stale.is_stale("b")
    assert not stale.load_snapshot("b", KVSnapshot(3, (1,), b"\x03"))  # buffered 5 does not follow 3
    assert stale.load_snapshot("b", KVSnapshot(4, (1,), b"\x03"))
    with pytest.raises(ValueError, match="states"):
        KVSnapshot(0, (1, 2), b"\x01")


def test_removed_worker_leaves_the_index_and_sweep_frees_its_slot():
    idx = ClusterPrefixIndex(page_size=4, window=8)
    idx.apply("a", [_stored(0, [1, 2, 3], (True,) * 3)])
    idx.apply("b", [_stored(0, [1, 2], (True,) * 2)])
    assert set(idx.predict([1, 2, 3], 13)) == {"a", "b"} and len(idx) == 3 and idx.entries() == 5
    idx.remove_worker("a")
    assert set(idx.predict([1, 2, 3], 13)) == {"b"} and idx.entries() == 2
    assert idx.needs_sweep and idx.sweep() == 3 and len(idx) == 2 and not idx.needs_sweep
    idx.apply("c", [_stored(0, [9], (True,))])  # the freed slot is reused, clean
    assert idx.blocks_of("c") == {9: 3} and set(idx.predict([1, 2, 3], 13)) == {"b"}


def test_sweep_in_slices_keeps_predictions_and_events_right_in_between():
    idx = ClusterPrefixIndex(page_size=4, window=8)
    chain = list(range(1, 41))
    idx.apply("a", [_stored(0, chain, (True,) * 40)])
    idx.apply("b", [_stored(0, chain[:20], (True,) * 20)])
    want_b = idx.predict(chain, 161)["b"]
    idx.remove_worker("a")
    steps = idx.sweep_steps(batch=7)
    assert next(steps) == 7  # the first slice: 7 of a's 40 blocks cleared
    # in between: a is not predicted, b is; a new worker's events land (on a fresh slot, not a's), and b's too
    assert set(idx.predict(chain, 161)) == {"b"} and idx.predict(chain, 161)["b"] == want_b
    idx.apply("c", [_stored(0, chain[:8], (True,) * 8)])
    idx.apply("b", [_stored(1, chain[20:30], (True,) * 10, parent=chain[19])])
    assert list(steps)[-1] == 40 and not idx.needs_sweep
    assert idx.blocks_of("c") == dict.fromkeys(chain[:8], 3) and len(idx.blocks_of("b")) == 30
    assert set(idx.predict(chain, 161)) == {"b", "c"} and idx.predict(chain, 161)["c"].tokens == 32
    idx.apply("d", [_stored(0, [99], (True,))])  # a's slot, free again and clean
    assert idx.blocks_of("d") == {99: 3} and "a" not in idx.workers


def test_events_today_lose_swa_that_ends_no_valid_window_yet():
    """Why STORED events carry `swa_held`: from the validity flags alone the index cannot know that a node
    holds SWA pages whose window is incomplete; a later heal of the ancestor completes it."""
    assert held_from_flags((False, False, False, True), 2) == (False, False, True, True)
    assert held_from_flags((True, False), 3) == (True, False)
    idx = ClusterPrefixIndex(page_size=4, window=12)  # 3 pages
    chain = [1, 2, 3, 4, 5]
    idx.apply("a", [KVEvent(0, EventKind.STORED, Tier.DEVICE, (1, 2, 3), None, (False,) * 3),
                    KVEvent(1, EventKind.STORED, Tier.DEVICE, (4, 5), 3, (False, False))])
    idx.apply("a", [KVEvent(2, EventKind.STORED, Tier.DEVICE, (1, 2, 3), None, (False, False, False))])
    assert idx.predict(chain, 21)["a"].tokens == 0  # with swa_held=(F, F, T) / (T, T) it is 20


def test_memory_per_block_is_bounded():
    idx = ClusterPrefixIndex(page_size=4, window=8)
    for w in range(32):
        idx.apply(f"w{w}", [_stored(0, range(w * 10_000, w * 10_000 + 10_000), (True,) * 10_000)])
    per_block = idx.memory_bytes() / len(idx)
    assert len(idx) == 320_000 and per_block < 160, per_block
    assert BlockState(idx.blocks_of("w31")[310_000]) == BlockState.DEVICE | BlockState.DEVICE_SWA


# ------------------------------------------------------------------------------------------ the cost


def _fleet_index():
    from libs.routing import Fleet, Instance
    idx = ClusterPrefixIndex(page_size=4, window=8)
    chain = list(range(1, 11))  # 10 pages
    idx.apply("hot", [_stored(0, chain, (True,) * 10)])
    idx.apply("raw", [_stored(0, chain, (False,) * 10)])  # full KV, no SWA: raw overlap, no valid hit
    fleet = Fleet(workers=tuple(Instance(i) for i in ("hot", "raw", "cold")))
    return idx, chain, fleet


def test_affinity_prefers_the_valid_hit_and_raw_credit_is_fooled():
    from libs.routing import AffinityRouter, AffinityWeights
    idx, chain, fleet = _fleet_index()
    r = AffinityRouter(idx).route(fleet, "q1", 41, now=0.0, block_hashes=chain)
    assert (r.prefill, r.decode, r.predicted_hit) == ("hot", "hot", 40)
    idx2, _, _ = _fleet_index()
    idx2.remove_worker("hot")
    raw = AffinityRouter(idx2, weights=AffinityWeights(credit="raw")).route(fleet, "q1", 41, 0.0, block_hashes=chain)
    assert (raw.prefill, raw.predicted_hit) == ("raw", 40)  # predicted 40, `match` there gives 0
    valid = AffinityRouter(idx2).route(fleet, "q1", 41, 0.0, block_hashes=chain)
    assert valid.predicted_hit == 0


def test_affinity_trades_the_hit_against_queue_and_decode_load():
    from dataclasses import replace

    from libs.routing import AffinityRouter, Fleet
    idx, chain, fleet = _fleet_index()
    busy = Fleet(workers=tuple(replace(i, prefill_tokens_queued=100) if i.instance_id == "hot" else i
                               for i in fleet.workers))
    r = AffinityRouter(idx)
    assert r.route(busy, "q", 41, 0.0, block_hashes=chain).prefill != "hot"  # 1 + 100 queued > 41 to compute
    r2 = AffinityRouter(idx)
    assert r2.route(fleet, "a", 41, 0.0, block_hashes=chain).prefill == "hot"
    # this router's own picks count as queued work (their predicted prefill tokens) until the load shows them
    for i in range(3):
        r2.route(fleet, f"long{i}", 401, 0.1, block_hashes=chain)
    assert r2.recent.counts(0.2)["hot"] >= 361 + 1


def test_buckets_count_uncached_tokens_and_ties_break_by_xxhash():
    from libs.routing import AffinityRouter, Fleet, Instance, choose, tie_break
    idx, chain, _ = _fleet_index()
    fleet = Fleet(workers=(Instance("hot", buckets=(0,)), Instance("long", buckets=(1,))))
    r = AffinityRouter(idx, bucket_edges=(16,))
    assert r.route(fleet, "q", 41, 0.0, block_hashes=chain).prefill == "hot"  # 1 uncached token: bucket 0 there
    costs = {"a": 1.0, "b": 1.0, "c": 2.0}
    want = min(("a", "b"), key=lambda i: tie_break("rid", i))
    assert choose(costs, "rid") == want and choose(dict(reversed(costs.items())), "rid") == want
    picks = {choose(costs, f"r{i}", temperature=1.0, scale=1.0) for i in range(200)}
    assert picks == {"a", "b", "c"}  # softmax samples every worker ...
    assert [choose(costs, f"r{i}", 1.0) for i in range(50)] == [choose(costs, f"r{i}", 1.0) for i in range(50)]
