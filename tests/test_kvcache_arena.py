"""Unit tests of the one-arena KV cache (issue #13): the split between the groups follows the workload, full KV
stays when only its checkpoint goes, retention learning is not fooled by its own evictions, the stats say why."""

from __future__ import annotations

import pytest

from libs.kvcache import MIMO_V25_PRO, KVCache, KVCacheConfig, plan_arena
from libs.kvcache.retention import ReuseStats
from tests.fixtures.kvcache_oracle import Oracle
from tests.test_kvcache import serve

pytestmark = pytest.mark.unit


def arena(units: int, **kw: object) -> KVCacheConfig:
    """Page 4, window 8; an SWA page is 3 units (a full page 1), like a model with 3x the SWA layers."""
    base: dict[str, object] = dict(page_size=4, window=8, num_full_pages=0, num_swa_pages=0, arena_units=units,
                                   full_page_units=1, swa_page_units=3, retention="none")
    base.update(kw)
    return KVCacheConfig(**base)  # type: ignore[arg-type]


def test_plan_arena_sizes_one_budget_in_units_of_the_pages_gcd() -> None:
    plan = plan_arena(64 << 30, MIMO_V25_PRO, 64)
    assert (plan.full_page_units, plan.swa_page_units) == (1, 6)  # 60 SWA vs 10 full layers, same bytes per layer
    assert plan.unit_bytes == MIMO_V25_PRO.full_page_bytes(64) and plan.units == (64 << 30) // plan.unit_bytes
    with pytest.raises(ValueError, match="replaces num_full_pages"):
        KVCacheConfig(page_size=4, window=8, num_full_pages=8, num_swa_pages=0, arena_units=64)


def test_checkpoints_take_the_bytes_full_kv_leaves_free() -> None:
    """Six 17-token conversations, each leaving a 2-page window (6 units) and 4 full pages (60 units in all),
    then their follow-ups (14 units each while running). A static split of the same 80 units with 8 SWA pages
    (24 units) keeps a few windows and has full pages to spare; the arena keeps all six: every follow-up hits."""
    prompts = [[k * 1000 + i for i in range(17)] for k in range(6)]
    hits = {}
    for name, c in (("arena", KVCache(arena(80), audit_tokens=True)),
                    ("static", KVCache(KVCacheConfig(page_size=4, window=8, num_full_pages=56, num_swa_pages=8,
                                                     retention="none"), audit_tokens=True))):
        o = Oracle(c)
        for k, p in enumerate(prompts):
            serve(o, f"a{k}", p)
        hits[name] = sum(serve(o, f"b{k}", p + [7]) for k, p in enumerate(prompts))
        u = c.usage()
        assert u.full.in_use == u.swa.in_use == 0
    assert hits["arena"] == 6 * 16 and hits["static"] <= 3 * 16


def test_a_leaf_keeps_its_full_kv_when_its_checkpoint_goes_and_serves_a_rebuild_hit() -> None:
    """Arena with rebuilds: the SWA victim is a leaf's end checkpoint; the leaf stays as a tombstone (full KV
    kept, SWA_REMOVED sent) and a follow-up gets a rebuild hit at its end. Without the arena the leaf leaves."""
    long = list(range(41))  # 10 pages
    for arena_on, want_raw in ((True, 40), (False, 0)):
        c = KVCache(arena(90, rebuild_tokens=16) if arena_on else KVCacheConfig(
            page_size=4, window=8, num_full_pages=60, num_swa_pages=10, rebuild_tokens=16, retention="none"),
            audit_tokens=True)
        o = Oracle(c)
        serve(o, "a", long)
        (leaf,) = c.root.children.values()
        assert c.index.evict_swa(leaf) is not arena_on  # True: the node left the tree
        c.check_invariants()
        hit = c.match(long + [5])
        assert hit.raw_tokens == want_raw
        if arena_on:
            assert hit.is_rebuild and (hit.tokens, hit.full_tokens) == (24, 40)
            o.check_hit(long + [5], hit)
            assert o.admit("b", long + [5], hit, 0).ok
            o.running.pop("b")
            c.abort("b")
            assert c.cache_stats().evictions["tombstone_pruned"] == (0, 0)
        else:
            c.release_hit(hit)
            assert c.cache_stats().evictions["tombstone_pruned"][1] == 10
        c.check_invariants()


def test_arena_eviction_weighs_recompute_saved_per_unit_across_groups() -> None:
    """A stem's end checkpoint (inner once an extension hangs below it: 6 units, saves the stem's 16 tokens)
    against the extension leaf (4 full pages + its window, 10 units, saves 16 tokens), one tick apart in
    recency. Per unit the stem's checkpoint is cheaper to lose: it goes as a tombstone, its full KV stays and
    still serves the extension's hit; the leaf stays."""
    c = KVCache(arena(36), audit_tokens=True)
    o = Oracle(c)
    stem, ext = list(range(16)), list(range(100, 116))
    serve(o, "s", stem + [1])
    serve(o, "x", stem + ext + [2])
    serve(o, "u", list(range(500, 540)))  # 10 full pages + window and page of SWA: 3 units short
    ev = c.cache_stats().evictions
    assert ev["swa"] == (1, 6) and ev["full"] == ev["swa_leaf"] == (0, 0)
    for tokens, want in ((stem + [9], 0), (stem + ext + [9], 32)):
        hit = c.match(tokens)
        assert hit.tokens == want
        c.release_hit(hit)
    a = c.usage().arena
    assert a is not None and a.free + a.full_cached + a.swa_cached == 36 and a.full_in_use == a.swa_in_use == 0


class _Ckpt:
    kinds = 0


def test_censored_retention_learning_keeps_a_kind_warm_that_its_evictions_would_make_cold() -> None:
    """A kind reused 10 ticks after it is stored, then 200 of its checkpoints evicted unreused 2 ticks after
    storing (memory short): without censoring they count as never reused and the kind turns cold; with it they
    are no evidence (younger than the kind's reuse age) and the kind stays warm."""
    end = 1  # CheckpointKind.END
    cold = {}
    for censor in (False, True):
        st = ReuseStats(censor=censor)
        for _ in range(4):
            n = _Ckpt()
            st.learn(n, end)
            st.reused(n, 10)
        for _ in range(200):
            n = _Ckpt()
            st.learn(n, end)
            st.evicted(n, 2)
        cold[censor] = st.checkpoint_stats()["end"][2]
        assert st.censored == (200 if censor else 0)
    assert cold == {False: True, True: False}


def test_cache_stats_count_hit_tokens_lost_to_missing_swa() -> None:
    c = KVCache(arena(90, retention="none"), audit_tokens=True)
    o = Oracle(c)
    a = list(range(33))
    serve(o, "a", a)
    serve(o, "b", a[:16] + list(range(500, 517)))  # shares 16 tokens with a, whose window is at 32: no SWA at 16
    st = c.cache_stats()
    assert (st.raw_hit_tokens, st.valid_hit_tokens, st.swa_lost_tokens) == (16, 0, 16)
