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


def test_pages_hold_their_units_and_the_audit_catches_a_unit_held_twice() -> None:
    """The ledger's unit map: a page id handed out takes its group's units from the one free-unit list (a full
    page 1, an SWA page 3, interleaved anywhere), freeing returns them; a corrupted table fails the audit."""
    from libs.kvcache.ledger import ArenaLedger, Held
    led = ArenaLedger(12, 1, 3)
    f, s = led.grant(2, 2)
    held = {u for p in f for u in led.page_units("full", p)} | {u for p in s for u in led.page_units("swa", p)}
    assert len(held) == 8 == 12 - led.free_units()
    led.free_private(list(f[:1]), [])
    _, s2 = led.grant(0, 1)  # 5 units free (1 returned by the full page): an SWA page takes 3 of them
    assert led.free_units() == 2 and set(led.page_units("swa", s2[0])).isdisjoint(
        {u for p in s for u in led.page_units("swa", p)})
    seqs = Held(full=list(f[1:]), swa=list(s) + list(s2))
    led.check_invariants(Held(), seqs)
    table, per_page = led.unit_table("swa")
    table[s2[0] * per_page] = table[s[0] * per_page]  # one unit now in two pages
    with pytest.raises(AssertionError, match="once each"):
        led.check_invariants(Held(), seqs)


def test_plan_arena_units_hold_whole_layers() -> None:
    """The tiny model's layout (2 full layers of 1 KV head, 4 SWA + 3 MTP layers of 2) and one where the pages'
    gcd does not hold a whole SWA layer (3 full layers of 1 head): the unit is whole layer planes, the waste
    is reported."""
    from libs.kvcache import KVLayout
    tiny = plan_arena(1 << 20, KVLayout(2, 7, 192, 384), 16)  # float32: 48 dims x 4 B per head
    assert (tiny.unit_bytes, tiny.full_page_units, tiny.swa_page_units, tiny.waste) == (6144, 1, 7, (0.0, 0.0))
    odd = plan_arena(1 << 20, KVLayout(3, 4, 192, 384), 16)  # page gcd 3072 B < one SWA layer-page (6144 B)
    assert odd.unit_bytes % 6144 == 0 and odd.unit_bytes % 3072 == 0
    assert odd.full_page_units * odd.unit_bytes >= 3 * 3072 and odd.swa_page_units * odd.unit_bytes >= 4 * 6144
    assert odd.waste == pytest.approx((1 / 3, 0.0))


def test_host_arena_holds_the_checkpoints_a_static_host_split_of_the_same_bytes_cannot() -> None:
    """Four 17-token conversations, each a 4-page node with its 2-page window (4 + 2 x 3 = 10 host units), backed
    up to a host tier of 46 units: as two host pools of 40 full + 2 SWA pages only one copy with its checkpoint
    fits (the others cannot be backed up: no SWA room, though 36 full pages are free); one host arena of the
    same 46 units holds all four. Then the device is flooded: the follow-ups that find their copy in the host
    tier hit it (loaded back), the others recompute. Units free + cached == host arena after every step."""
    prompts = [[k * 1000 + i for i in range(17)] for k in range(4)]
    hits = {}
    for name, host in (("arena", dict(host_arena_units=46)), ("static", dict(num_host_full_pages=40,
                                                                              num_host_swa_pages=2))):
        o = Oracle(KVCache(arena(60, **host), audit_tokens=True))
        for k, p in enumerate(prompts):
            serve(o, f"a{k}", p)
        o.run_copies(o.cache.backup_to_host(64))
        o.cache.check_invariants()
        h = o.cache.usage().host_arena
        if name == "arena":
            assert h is not None and (h.full_cached, h.swa_cached, h.free) == (16, 24, 6)
        # flood the device (50 full pages + its window: 59 of 60 units): every cached node leaves it, the
        # backed-up ones stay in the host tier
        serve(o, "flood", [90_000 + i for i in range(200)], cache=False)
        assert all(n.full is None for n in o.cache.index.nodes.values())
        hits[name] = sum(serve(o, f"b{k}", p + [7, 7, 7]) > 0 for k, p in enumerate(prompts))
        assert o.cache.usage().full.in_use == 0
    assert (hits["arena"], hits["static"]) == (4, 1), hits


def test_host_arena_config_and_sizing() -> None:
    """host_arena_units replaces the host page counts; the engine sizes the host tier as one byte budget with a
    device arena (the page counts' bytes, or host_kv_bytes), and splits host_kv_bytes like the device pools
    without one."""
    from libs.engine.config import EngineConfig
    from libs.engine.core import arena_plan, host_plan
    from libs.engine.gcache_tier import kv_layout
    from libs.model.config import ModelConfig

    with pytest.raises(ValueError, match="replaces num_host_full_pages"):
        arena(60, host_arena_units=10, num_host_full_pages=4, num_host_swa_pages=2)
    with pytest.raises(ValueError, match="host_kv_bytes replaces"):
        EngineConfig(host_kv_bytes=1 << 20, num_host_full_pages=4, num_host_swa_pages=2)
    mc = ModelConfig.tiny()
    layout = kv_layout(mc, EngineConfig().torch_dtype)
    fpb, spb = layout.full_page_bytes(16), layout.swa_page_bytes(16)
    pages = EngineConfig(num_host_full_pages=64, num_host_swa_pages=32)
    by_bytes = EngineConfig(host_kv_bytes=64 * fpb + 32 * spb)
    a = arena_plan(pages, mc)
    hp = host_plan(pages, mc, a)
    assert hp.arena is not None and (hp.full, hp.swa) == (0, 0) and hp == host_plan(by_bytes, mc, a)
    assert hp.arena.units * hp.arena.unit_bytes == 64 * fpb + 32 * spb and hp.arena.unit_bytes == a.unit_bytes  # type: ignore[union-attr]
    static = EngineConfig(kv_arena=False, num_full_pages=2048, num_swa_pages=512, host_kv_bytes=100 * fpb + 25 * spb)
    assert host_plan(static, mc, None) == type(hp)(100, 25)  # the device pools' byte shares: 2048:512 = 100:25
    assert host_plan(EngineConfig(kv_arena=False, num_host_full_pages=8, num_host_swa_pages=3), mc, None) == (
        type(hp)(8, 3))
    assert host_plan(EngineConfig(), mc, a) == type(hp)()  # no host tier
