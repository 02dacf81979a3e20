"""libs/routing (pure): length buckets, worker and pair choice, recent picks, tie-breaks, the router's decision."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from libs.routing import (
    DEFAULT_BUCKET_EDGES,
    Fleet,
    Instance,
    LengthBuckets,
    RecentPicks,
    Reflected,
    Route,
    Router,
    instance_of,
    pick_pair,
    pick_worker,
    tie_break,
)

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _inst(iid, running=0, waiting=0, buckets=(), address="ucx://h:1", used=0, updated_at=None, arrivals=None):
    return Instance(iid, address=address, buckets=tuple(buckets), running=running, waiting=waiting,
                    kv_full_used=used, kv_full_total=100, updated_at=updated_at, arrivals=arrivals)


# ------------------------------------------------------------------------------------------ length buckets
def test_length_buckets_classify_at_the_edges_and_bound_each_bucket():
    b = LengthBuckets((10, 100))
    assert [b.classify(n) for n in (0, 9, 10, 99, 100, 10**9)] == [0, 0, 1, 1, 2, 2]
    assert [b.bounds(i) for i in range(b.num_buckets)] == [(0, 10), (10, 100), (100, None)]
    assert LengthBuckets(()).num_buckets == 1 and LengthBuckets(()).classify(10**9) == 0
    assert LengthBuckets([5, 7]).edges == (5, 7)  # any sequence of ints, stored as a tuple
    for bad in ((0,), (10, 10), (10, 5)):
        with pytest.raises(ValueError, match="edges"):
            LengthBuckets(bad)
    with pytest.raises(ValueError, match="uncached_tokens"):
        b.classify(-1)
    with pytest.raises(ValueError, match="out of range"):
        b.bounds(3)


def test_every_service_holds_the_one_bucket_config():
    from libs.buckets import BucketConfig
    from libs.engine.scheduler import SchedulerConfig
    from services.gateway.backend import BackendConfig
    from services.router.config import RouterConfig
    assert SchedulerConfig().buckets == BackendConfig().buckets == RouterConfig().buckets == BucketConfig()
    assert LengthBuckets().edges == BucketConfig().bucket_edges == DEFAULT_BUCKET_EDGES
    # the literal is written once: every other default refers to DEFAULT_BUCKET_EDGES
    literal = re.compile(r"\b65536,\s*262144\b")
    hits = [str(p.relative_to(ROOT)) for d in ("libs", "services") for p in (ROOT / d).rglob("*.py")
            if literal.search(p.read_text())]
    assert hits == ["libs/buckets.py"]


def test_router_config_rejects_bad_edges():
    from services.router.config import RouterConfig
    with pytest.raises(ValueError, match="strictly increasing"):
        RouterConfig(bucket_edges=[100, 10])


# ------------------------------------------------------------------------------------------ registry view
def test_instance_of_a_registry_entry():
    from protos.messages import RegistryEntry, Role, WorkerLoad
    idle = instance_of(RegistryEntry(role=Role.DECODE, instance_id="d0", address="ucx://a", buckets=[1],
                                     max_tokens=4096))
    assert idle == Instance("d0", address="ucx://a", buckets=(1,), max_tokens=4096)
    assert (idle.queue, idle.kv_share, idle.updated_at) == (0, 0.0, None)  # no load reported: idle
    busy = instance_of(RegistryEntry(role=Role.WORKER, instance_id="w0", load=WorkerLoad(
        running=2, waiting=3, kv_full_used=25, kv_full_total=100, kv_swa_used=7, updated_at=12.5)))
    assert (busy.queue, busy.kv_share, busy.updated_at, busy.address) == (5, 0.25, 12.5, "")
    # one arena: the share is the arena's (units in use or promised / units), not the full group's pages,
    # whose total moves with the other group's use
    arena = instance_of(RegistryEntry(role=Role.WORKER, instance_id="w1", load=WorkerLoad(
        kv_full_used=25, kv_full_total=30, kv_units_used=300, kv_units_total=1000, updated_at=12.5)))
    assert arena.kv_share == 0.3
    assert pick_worker([arena, Instance("w2", kv_full_used=10, kv_full_total=100)], 1, LengthBuckets(()),
                       "q").instance_id == "w2"
    assert pick_worker([arena, Instance("w2", kv_full_used=40, kv_full_total=100)], 1, LengthBuckets(()),
                       "q").instance_id == "w1"  # (by its full pages, 25 / 30, it would look the fuller)


# ------------------------------------------------------------------------------------------ tie-breaks
def test_tie_break_is_xxhash_of_request_and_instance_stable_across_processes():
    # pinned values: a change of hash function or key format changes every pick of a live deployment
    assert tie_break("r1", "d0") == 18369812017609520416
    assert tie_break("r1", "d1") == 9601750407501237508
    code = "from libs.routing import tie_break; print(tie_break('q', 'p-short'))"
    out = {subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                          env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip() for seed in ("1", "2")}
    assert out == {str(tie_break("q", "p-short"))}  # hash() would differ between these two processes


def test_equal_workers_split_by_tie_break_deterministically():
    same = [_inst(f"w{i}") for i in range(4)]
    b = LengthBuckets((100,))
    picks = [pick_worker(same, 10, b, f"r{i}").instance_id for i in range(40)]
    assert len(set(picks)) > 1  # a burst spreads over equally idle workers
    assert picks == [pick_worker(list(reversed(same)), 10, b, f"r{i}").instance_id for i in range(40)]  # order-free
    assert (pick_worker(same, 10, b, "r1").instance_id
            == min(same, key=lambda w: tie_break("r1", w.instance_id)).instance_id)


# ------------------------------------------------------------------------------------------ worker choice
def test_pick_worker_by_bucket_then_queue_then_kv_share():
    b = LengthBuckets((100,))
    workers = [_inst("short", buckets=[0], running=2), _inst("long", buckets=[1], waiting=1),
               _inst("any", running=2, used=10)]
    assert pick_worker(workers, 10, b, "q").instance_id == "short"  # same queue as "any", lower KV share
    assert pick_worker(workers, 500, b, "q").instance_id == "long"  # "short" does not serve bucket 1
    # nobody serves the bucket: everyone is a candidate (a misrouted request still gets served)
    assert pick_worker([_inst("a", buckets=[0], running=1), _inst("b", buckets=[0])], 500, b, "q").instance_id == "b"
    with pytest.raises(LookupError, match="no live worker"):
        pick_worker([], 1, b, "q")


# ------------------------------------------------------------------------------------------ router pairs
def test_pick_pair_by_bucket_and_load():
    prefills = [_inst("p-short", buckets=[0]), _inst("p-long", buckets=[1], waiting=5), _inst("p-any", running=7)]
    decodes = [_inst("d-busy", running=3), _inst("d-idle", used=50), _inst("d-noaddr", address="")]
    edges = LengthBuckets((100,))
    assert [e.instance_id for e in pick_pair(prefills, decodes, 10, edges, "q")] == ["p-short", "d-idle"]
    # long prompt: only p-long and the catch-all p-any serve bucket 1; p-long has the shorter queue
    assert pick_pair(prefills, decodes, 500, edges, "q")[0].instance_id == "p-long"
    # this router's own recent picks count as load (a burst between two registry refreshes spreads)
    assert pick_pair(prefills, decodes, 10, edges, "q", {"p-short": 9, "d-idle": 9})[1].instance_id == "d-busy"
    # equal load: ties broken by the KV share, then by a deterministic hash
    same = [_inst(f"d{i}") for i in range(4)]
    picks = {pick_pair(prefills, same, 10, edges, f"r{i}")[1].instance_id for i in range(40)}
    assert len(picks) > 1 and pick_pair(prefills, same, 10, edges, "r1") == pick_pair(prefills, same, 10, edges, "r1")


def test_pick_pair_needs_both_roles_and_an_address():
    none = LengthBuckets(())
    with pytest.raises(LookupError, match="prefill"):
        pick_pair([], [_inst("d")], 1, none, "q")
    with pytest.raises(LookupError, match="transfer address"):
        pick_pair([_inst("p")], [_inst("d", address="")], 1, none, "q")
    # decode workers that refused the request (full) are not offered again
    two = [_inst("d0"), _inst("d1")]
    assert pick_pair([_inst("p")], two, 1, none, "q", exclude_decodes=["d0"])[1].instance_id == "d1"
    with pytest.raises(LookupError, match="besides"):
        pick_pair([_inst("p")], two, 1, none, "q", exclude_decodes=["d0", "d1"])


# ------------------------------------------------------------------------------------------ recent picks
def test_recent_picks_count_the_window_and_skip_picks_already_in_the_load():
    recent = RecentPicks(window_s=2.0)
    recent.add("a", 10.0)
    recent.add("a", 11.5)
    assert recent.counts(11.9) == {"a": 2} and recent.counts(13.0) == {"a": 1} and recent.counts(20) == {}
    # picks older than the instance's load snapshot are in that load already: not counted twice
    recent.add("a", 30.0)
    recent.add("a", 30.4)
    recent.add("b", 30.1)
    assert recent.counts(30.5, {"a": Reflected(30.2), "b": Reflected(29.0)}) == {"a": 1, "b": 1}
    assert recent.counts(30.5, {"a": Reflected(30.45)}) == {"b": 1}
    with pytest.raises(ValueError, match="window_s"):
        RecentPicks(window_s=0)


def test_recent_picks_covered_only_once_the_instance_counts_their_arrival():
    """An instance reporting its arrivals: a snapshot newer than a pick but taken before the request reached the
    instance (a decode worker learns of it only at kv_prepare) does not cover it; one whose count reached the
    pick's does. Two picks in a row need two arrivals; a replayed pick of the same request needs one."""
    recent = RecentPicks(window_s=2.0)
    assert recent.counts(10.0, {"d": Reflected(9.9, arrivals=5)}) == {}
    recent.add("d", 10.0, request_id="r1")
    recent.add("d", 10.1, request_id="r2")
    recent.add("d", 10.15, request_id="r2")  # the same request again (a replica's copy)
    assert recent.counts(10.3, {"d": Reflected(10.2, arrivals=5)}) == {"d": 2}  # newer, yet neither arrived
    assert recent.counts(10.4, {"d": Reflected(10.3, arrivals=6)}) == {"d": 1}
    assert recent.counts(10.5, {"d": Reflected(10.4, arrivals=7)}) == {}
    # the next pick's target follows the latest count seen, not the covered picks'
    recent.add("d", 10.6, request_id="r3")
    assert recent.counts(10.7, {"d": Reflected(10.65, arrivals=7)}) == {"d": 1}
    assert recent.counts(10.8, {"d": Reflected(10.75, arrivals=8)}) == {}
    # a pick whose request never arrives counts until the window ends; one made with no count known falls
    # back to the snapshot time
    recent.add("d", 11.0, request_id="lost")
    assert recent.counts(12.9, {"d": Reflected(12.8, arrivals=8)}) == {"d": 1}
    assert recent.counts(13.1, {"d": Reflected(13.0, arrivals=8)}) == {}
    recent.add("x", 20.0)
    assert recent.counts(20.2, {"x": Reflected(20.1)}) == {}


def test_two_quick_picks_spread_over_decoders_whose_snapshots_predate_the_arrivals():
    """The herding case: both decode workers idle by loads refreshed after the first pick but before its
    kv_prepare reached d0; the second request goes to d1 all the same (both policies)."""
    from libs.routing import AffinityRouter, ClusterPrefixIndex
    now = 100.0
    prefill = _inst("p", updated_at=now - 0.1, arrivals=0)
    idle = [_inst("d0", updated_at=now - 0.1, arrivals=3), _inst("d1", updated_at=now - 0.1, arrivals=3)]
    later = Fleet(prefills=(prefill,), decodes=tuple(replace(d, updated_at=now + 0.05) for d in idle))
    for make in (Router, lambda: AffinityRouter(ClusterPrefixIndex(4, 8), ())):
        router = make()
        first = router.route(Fleet(prefills=(prefill,), decodes=tuple(idle)), "req-a", 40, now).decode
        # a request the tie-break alone (both idle) sends to the same decoder: the snapshot time alone herds it
        rid = next(f"req-b{k}" for k in range(100) if make().route(later, f"req-b{k}", 40, now + 0.1).decode == first)
        assert router.route(later, rid, 40, now + 0.1).decode != first
    # (router: the affinity policy, the loop's last) a prefill asking again after `first` refused the request:
    # its pick there stops counting
    retried = router.route(later, "req-a", 40, now + 0.2, exclude_decodes=[first])
    assert retried.decode != first and router.recent_decodes.counts(now + 0.2).get(first, 0) == 0
    replica = AffinityRouter(ClusterPrefixIndex(4, 8), ())  # a replica's shared pick counts on its decode too
    replica.note_pick("req-a", "p", "d0", now, 40)
    assert replica.recent_decodes.counts(now + 0.1) == {"d0": 1}


def test_recent_picks_forget_what_left_the_window():
    recent = RecentPicks(window_s=1.0)
    for t in (0.0, 0.5, 1.2):
        recent.add("a", t)
    recent.add("b", 0.1)
    assert recent.counts(1.3) == {"a": 2}
    assert recent.counts(1.3, {"a": Reflected(1.3)}) == {}  # a snapshot newer than every pick reflects them all
    assert recent.counts(1.3, {"a": Reflected(0.0)}) == {"a": 2}  # and one older than the window changes nothing
    assert recent.counts(0.3) == {"a": 2}  # forgotten picks stay forgotten, even asked about an earlier time


# ------------------------------------------------------------------------------------------ the router
def test_router_spreads_a_burst_over_equal_decodes_until_the_load_catches_up():
    router = Router((100,))
    fleet = Fleet(prefills=(_inst("p", updated_at=0.0),), decodes=(_inst("d0", updated_at=0.0),
                                                                   _inst("d1", updated_at=0.0)))
    routes = [router.route(fleet, f"r{i}", 10, now=1.0 + i / 100) for i in range(4)]
    assert sorted(r.decode for r in routes) == ["d0", "d0", "d1", "d1"]  # recent picks balance the burst
    assert router.recent.counts(1.1) == {"p": 4, "d0": 2, "d1": 2}
    # d0's load snapshot now holds its two requests (d1's is stale): d0's picks are not counted twice, so both
    # queues are 2 and the tie-break decides ("r2" prefers d0; counting twice would send it to d1)
    fresh = Fleet(prefills=fleet.prefills, decodes=(_inst("d0", running=2, updated_at=1.05), fleet.decodes[1]))
    assert router.recent.counts(1.1, {"d0": Reflected(1.05), "d1": Reflected(0.0)}) == {"p": 4, "d1": 2}
    assert tie_break("r2", "d0") < tie_break("r2", "d1")
    assert router.route(fresh, "r2", 10, now=1.1).decode == "d0"


def test_router_modes_and_the_retry_that_keeps_its_prefill_pick():
    router = Router(())
    pair = Fleet(prefills=(_inst("p"),), decodes=(_inst("d0"), _inst("d1")), workers=(_inst("w"),))
    first = router.route(pair, "a", 5, now=1.0)
    assert pair.disaggregated and first.prefill == "p"  # combined workers are unused then
    assert router.recent.counts(1.0) == {"p": 1, first.decode: 1}
    # a prefill asking again (its decode refused): the new decode pick counts, the prefill's stands as it was,
    # and the refused decode's pick no longer counts there
    retry = router.route(pair, "a", 5, now=1.0, exclude_decodes=[first.decode])
    assert retry.prefill == "p" and retry.decode != first.decode
    assert router.recent.counts(1.0) == {"p": 1, retry.decode: 1}
    assert router.route(Fleet(workers=(_inst("w0", running=1), _inst("w1"))), "c", 5, now=2.0) == Route("w1", "w1")
    with pytest.raises(LookupError, match="needs prefill and decode"):
        router.route(Fleet(prefills=(_inst("p"),)), "c", 5, now=2.0)
    with pytest.raises(LookupError, match="no live worker"):
        router.route(Fleet(), "c", 5, now=2.0)


# ------------------------------------------------------------------------------------------ retries and replicas
def test_exclude_instances_skips_failed_workers_in_every_choice():
    from libs.routing import AffinityRouter, ClusterPrefixIndex
    workers = [_inst("w0"), _inst("w1", running=3)]
    none = LengthBuckets(())
    assert pick_worker(workers, 1, none, "q").instance_id == "w0"
    assert pick_worker(workers, 1, none, "q", exclude_instances=["w0"]).instance_id == "w1"
    with pytest.raises(LookupError, match=r"besides \['w0', 'w1'\]"):
        pick_worker(workers, 1, none, "q", exclude_instances=["w0", "w1"])
    prefills = (_inst("p0"), _inst("p1", running=3))
    assert pick_pair(prefills, [_inst("d")], 1, none, "q", exclude_instances=["p0"])[0].instance_id == "p1"
    for router in (Router(()), AffinityRouter(ClusterPrefixIndex(4, 8), ())):
        assert router.route(Fleet(workers=tuple(workers)), "q", 8, 1.0, exclude_instances=["w0"]).prefill == "w1"
        pair = router.route(Fleet(prefills=prefills, decodes=(_inst("d"),)), "q", 8, 1.0, exclude_instances=["p0"])
        assert (pair.prefill, pair.decode) == ("p1", "d")
        with pytest.raises(LookupError, match="besides"):
            router.route(Fleet(workers=tuple(workers)), "q", 8, 1.0, exclude_instances=["w0", "w1"])


def test_recent_picks_name_their_request_so_replicas_count_each_request_once():
    recent = RecentPicks(window_s=2.0)
    recent.add("a", 1.0, 10, request_id="r1")
    recent.add("a", 1.1, 10, request_id="r1")  # the same request placed again (another replica): replaced
    recent.add("a", 1.2, 5, request_id="r2")
    recent.add("b", 1.2, 7, request_id="r1")
    assert recent.counts(1.5) == {"a": 15, "b": 7}
    assert recent.counts(1.5, skip_request="r1") == {"a": 5}  # a request is no load against itself
    assert recent.counts(3.15) == {"a": 5, "b": 7}  # the replaced pick's newer time counts


def test_replica_picks_count_as_load_and_spread_a_burst():
    from libs.routing import AffinityRouter, ClusterPrefixIndex
    fleet = Fleet(workers=tuple(_inst(f"w{i}") for i in range(4)))
    a, b = (AffinityRouter(ClusterPrefixIndex(4, 8), ()) for _ in range(2))
    picks = []
    for i in range(4):  # a burst split over two replicas that share their picks
        mine, other = (a, b) if i % 2 == 0 else (b, a)
        route = mine.route(fleet, f"q{i}", 100, now=1.0)
        other.note_pick(f"q{i}", route.prefill, route.decode, 1.0, 100 - route.predicted_hit)
        picks.append(route.prefill)
    assert sorted(picks) == ["w0", "w1", "w2", "w3"]  # without the shared picks: w0, w2, w2, w3
    # the least-loaded router counts replicas' picks in disaggregated mode (requests, not tokens)
    router = Router(())
    router.note_pick("x", "p", "d0", 1.0, 50)
    assert router.recent.counts(1.5) == {"p": 1, "d0": 1}
    pair = Fleet(prefills=(_inst("p"),), decodes=(_inst("d0"), _inst("d1")))
    assert router.route(pair, "y", 10, now=1.5).decode == "d1"


# ------------------------------------------------------------------------------------------ approximate index
def test_approx_index_predicts_the_longest_routed_prefix_until_its_ttl():
    from libs.routing import ApproxIndex
    idx = ApproxIndex(page_size=4, ttl_s=10.0)
    chain = list(range(100, 110))  # 10 pages
    idx.record("a", chain[:6], now=0.0)
    idx.record("b", chain, now=5.0)
    hits = idx.predict(chain, 41)
    assert (hits["a"].tokens, hits["b"].tokens) == (24, 40) and hits["b"].raw_tokens == 40
    assert idx.predict(chain, 40)["b"].tokens == 36  # capped like `match`: one token is left to compute
    assert idx.predict(chain[:3] + [999] + chain[4:], 41)["b"].tokens == 12  # a chain: stops at the first miss
    assert idx.predict([999] + chain, 45) == {}
    idx.record("a", chain[:2], now=8.0)  # routed again: its first two blocks live longer
    idx.expire(10.0)
    assert idx.predict(chain, 41)["a"].tokens == 8 and idx.entries() == 12
    idx.expire(15.0)
    assert set(idx.predict(chain, 41)) == {"a"}
    idx.remove_worker("a")
    assert idx.predict(chain, 41) == {} and len(idx) == 0 and idx.entries() == 0


def test_approx_index_is_bounded_and_drives_the_affinity_cost():
    from libs.routing import AffinityRouter, ApproxIndex
    idx = ApproxIndex(page_size=4, ttl_s=60.0, max_entries=8)
    idx.record("a", list(range(6)), now=0.0)
    idx.record("b", list(range(10, 16)), now=1.0)  # 12 entries > 8: a's oldest blocks go first
    assert idx.entries() == 8 and idx.predict(list(range(6)), 30) == {}
    assert idx.predict(list(range(10, 16)), 30)["b"].tokens == 24
    router = AffinityRouter(idx, ())
    fleet = Fleet(workers=(Instance("a"), Instance("b")))
    route = router.route(fleet, "q", 30, now=2.0, block_hashes=list(range(10, 16)))
    assert (route.prefill, route.predicted_hit) == ("b", 24)
