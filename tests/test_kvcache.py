"""Unit tests of the SWA-aware KV cache (pure logic, tiny shapes)."""

from __future__ import annotations

import pytest
import xxhash

from libs.kvcache import (
    MIMO_V25_PRO,
    EventKind,
    KVCache,
    KVCacheConfig,
    Tier,
    block_hashes,
    plan_pools,
    rebuild_span,
)
from tests.fixtures.kvcache_oracle import Oracle, Running

pytestmark = pytest.mark.unit


def cfg(**kw: object) -> KVCacheConfig:
    base: dict[str, object] = dict(page_size=4, window=8, num_full_pages=64, num_swa_pages=32)
    base.update(kw)
    return KVCacheConfig(**base)  # type: ignore[arg-type]


def serve(o: Oracle, sid: str, tokens: list[int], max_new: int = 0, chunk: int = 4, cache: bool = True) -> int:
    """match -> admit -> chunked prefill -> decode -> finish through the oracle engine; returns the hit."""
    hit = o.cache.match(tokens)
    o.check_hit(tokens, hit)
    res = o.admit(sid, tokens, hit, max_new)
    assert res.ok, res.reason
    while o.cache.num_computed(sid) < len(o.running[sid].tokens):
        left = len(o.running[sid].tokens) - o.cache.num_computed(sid)
        assert o.step(sid, min(chunk, left))
        o.cache.check_invariants()
    o.running.pop(sid)
    o.cache.finish(sid, cache=cache)
    o.cache.check_invariants()
    return hit.tokens


def swa_window_pages(c: KVCache, sid: str) -> int:
    return sum(1 for s in c.page_tables(sid)[1] if s >= 0)


# ---------------------------------------------------------------- config, hashing, planning


@pytest.mark.parametrize("kw, msg", [
    (dict(page_size=0), "page_size"),
    (dict(window=0), "window"),
    (dict(num_full_pages=-1), "num_full_pages"),
    (dict(retention="lru"), "retention"),
    (dict(checkpoint_align=6), "multiple of page_size"),
    (dict(num_host_full_pages=8), "host tier"),
    (dict(rebuild_tokens=10), "rebuild_tokens=10 must be a multiple of page_size"),
    (dict(rebuild_tokens=4), "and >= window"),
])
def test_config_rejects_bad_values_with_named_field(kw: dict[str, object], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        cfg(**kw)


def test_block_hashes_are_an_xxh64_chain_over_little_endian_uint32_pages() -> None:
    tokens = list(range(100, 111))
    h0 = xxhash.xxh64_intdigest(b"".join(t.to_bytes(4, "little") for t in tokens[:4]), seed=7)
    h1 = xxhash.xxh64_intdigest(b"".join(t.to_bytes(4, "little") for t in tokens[4:8]), seed=h0)
    assert block_hashes(tokens, 4, seed=7) == [h0, h1]  # partial last page is not hashed
    assert block_hashes(tokens[:8] + [0, 0], 4, seed=7) == [h0, h1]
    assert block_hashes(tokens, 4)[0] != block_hashes(tokens, 4, seed=8)[0]


def test_plan_pools_fits_budget_and_sizes_swa_from_window_per_running_sequence() -> None:
    budget = 64 << 30
    plan = plan_pools(budget, MIMO_V25_PRO, page_size=64, window=128, expected_seq_tokens=32768)
    fpb, spb = MIMO_V25_PRO.full_page_bytes(64), MIMO_V25_PRO.swa_page_bytes(64)
    assert plan.num_full_pages * fpb + plan.num_swa_pages * spb <= budget
    assert plan.num_swa_pages == plan.max_running * 3  # (128 + 64) / 64 pages each, no checkpoints asked
    assert plan.num_full_pages // 512 >= plan.max_running


# ---------------------------------------------------------------- sequence view and the SWA bound


def test_decode_of_ten_windows_keeps_swa_within_window_plus_page() -> None:
    # retention "none": no checkpoint pages, so every SWA page the sequence holds is its window.
    c = KVCache(audit_tokens=True,
                config=cfg(page_size=4, window=8, num_full_pages=64, num_swa_pages=8, retention="none"))
    o = Oracle(c)
    tokens = list(range(6))
    hit = c.match(tokens)
    assert c.admit("d", tokens, hit, 10 * 8).ok
    o.running["d"] = Running(tokens, 6, 80)
    assert o.step("d", 6)
    peak = 0
    for _ in range(10 * 8 - 1):
        assert o.step("d", 1)  # reserve + reads checked by the oracle + commit
        peak = max(peak, swa_window_pages(c, "d"), c.usage().swa.in_use)
        assert swa_window_pages(c, "d") <= c.cfg.seq_swa_pages  # window + page = 3 pages
        c.check_invariants()
    assert peak == c.cfg.seq_swa_pages
    assert len(c.page_tables("d")[0]) == -(-c.num_computed("d") // 4)


def test_chunked_prefill_frees_swa_pages_as_they_leave_the_window() -> None:
    c = KVCache(audit_tokens=True, config=cfg(retention="none"))
    o = Oracle(c)
    tokens = list(range(40))
    assert c.admit("p", tokens, c.match(tokens), 0).ok
    o.running["p"] = Running(tokens, 40, 0)
    for _ in range(10):
        assert o.step("p", 4)
        full, swa = c.page_tables("p")
        held = [j for j, s in enumerate(swa) if s >= 0]
        n = c.num_computed("p")
        assert held == list(range(max(0, n // 4 - 2), -(-n // 4)))  # exactly the window ending at n
        assert all(f >= 0 for f in full)


def test_reserve_refuses_without_memory_and_leaves_state_unchanged() -> None:
    c = KVCache(audit_tokens=True, config=cfg(num_full_pages=4, num_swa_pages=4))
    tokens = list(range(9))
    assert c.admit("a", tokens, c.match(tokens), 0).ok  # 3 full pages promised
    assert c.reserve("a", 9)
    c.commit("a", 9)
    before = (c.page_tables("a"), c.usage())
    assert not c.reserve("a", 8)  # beyond the promise: needs 2 more full pages, 1 left
    assert (c.page_tables("a"), c.usage()) == before
    c.check_invariants()


def test_commit_beyond_reserve_and_unknown_sequence_are_errors() -> None:
    c = KVCache(audit_tokens=True, config=cfg())
    tokens = list(range(6))
    assert c.admit("a", tokens, c.match(tokens), 2).ok
    with pytest.raises(ValueError, match="exceed the reserved"):
        c.commit("a", 1)
    with pytest.raises(KeyError, match="'zz' is not running"):
        c.reserve("zz", 1)
    with pytest.raises(ValueError, match="already running"):
        c.admit("a", tokens, c.match(tokens), 0)


# ---------------------------------------------------------------- admission


def test_admission_accounts_decode_growth_and_names_the_pool() -> None:
    c = KVCache(audit_tokens=True, config=cfg(num_full_pages=5, num_swa_pages=16))
    tokens = list(range(16))  # 4 pages
    assert c.admit("a", tokens, c.match(tokens), 4).ok  # 20 tokens -> 5 pages
    res = c.admit("b", [7] * 4, c.match([7] * 4), 0)
    assert not res.ok and "full pool" in res.reason and "needs 1 pages" in res.reason
    c.abort("a")
    c.check_invariants()
    res = KVCache(audit_tokens=True, config=cfg(num_full_pages=5, num_swa_pages=2)).admit(
        "c", tokens, KVCache(audit_tokens=True, config=cfg()).match([]), 0)
    assert not res.ok and "swa pool" in res.reason


def test_admission_evicts_unlocked_cache_but_never_running_pages() -> None:
    c = KVCache(audit_tokens=True, config=cfg(num_full_pages=12, num_swa_pages=12))
    o = Oracle(c)
    serve(o, "old", list(range(100, 133)))  # fills 8 full pages of cache
    assert c.usage().full.cached == 8
    hit = c.match(list(range(100, 133)) + [1])
    assert hit.tokens == 32
    assert c.admit("run", list(range(100, 133)) + [1], hit, 0).ok
    res = c.admit("big", list(range(500, 520)), c.match(list(range(500, 520))), 0)
    assert not res.ok  # 5 pages needed; the 8 cached pages are locked by "run"
    c.finish("run", cache=False)
    assert c.admit("big", list(range(500, 520)), c.match(list(range(500, 520))), 0).ok
    c.check_invariants()


# ---------------------------------------------------------------- prefix tree, tombstones, retention


def test_match_returns_longest_valid_hit_not_longest_token_match() -> None:
    c = KVCache(audit_tokens=True, config=cfg(retention="none"))
    o = Oracle(c)
    a = list(range(40))
    serve(o, "a", a)
    hit = c.match(a[:30] + [999] * 6)  # shares 28 tokens; SWA exists only at the end of "a" (pages 8, 9)
    assert hit.raw_tokens == 28 and hit.tokens == 0
    c.release_hit(hit)
    hit = c.match(a + [5])
    assert hit.tokens == 40 and hit.raw_tokens == 40
    c.release_hit(hit)
    with pytest.raises(KeyError, match="not live"):
        c.release_hit(hit)


def test_insert_heals_tombstones_at_the_branch_point() -> None:
    c = KVCache(audit_tokens=True, config=cfg(retention="checkpoints"))
    o = Oracle(c)
    a = list(range(40))
    serve(o, "a", a)
    b = a[:28] + [999] * 8
    assert serve(o, "b", b) == 0  # tombstone at 28: recomputed, and the branch point keeps its window
    assert c.match(a[:28] + [555] * 5).tokens == 28  # healed: a third request sharing the stem hits
    events = c.drain_events()
    assert [e.event_id for e in events] == list(range(len(events)))


def test_turn_boundary_checkpoint_serves_requests_that_share_only_the_prompt_blocks() -> None:
    prompt = list(range(37))  # 9 full pages + 1 token; the next turn shares the first 32 tokens (blocks of 8)
    follow = prompt[:32] + [777] * 10
    hits = {}
    for retention in ("checkpoints", "none"):
        o = Oracle(KVCache(audit_tokens=True, config=cfg(retention=retention, checkpoint_align=8)))
        serve(o, "t1", prompt, max_new=6)
        hits[retention] = serve(o, "t2", follow)
    assert hits == {"checkpoints": 32, "none": 0}


def test_prompt_end_checkpoint_serves_an_exact_repeat_of_a_page_aligned_prompt() -> None:
    prompt = list(range(40))  # 10 full pages: a repeat must leave a token, so it can resume at 36 at most
    hits = {}
    for retention in ("checkpoints", "none"):
        o = Oracle(KVCache(audit_tokens=True, config=cfg(retention=retention)))
        serve(o, "t1", prompt, max_new=6)
        hits[retention] = serve(o, "t2", prompt)
    assert hits == {"checkpoints": 36, "none": 0}


@pytest.mark.parametrize("retention", ["checkpoints", "all"])
def test_no_checkpoint_is_kept_over_swa_kv_below_swa_from(retention: str) -> None:
    """A disaggregated decode worker receives a prompt's SWA KV for its last window only (`swa_from`): the
    40-token prompt's PROMPT_END checkpoint (36) would need page 7, never written, so a repeat must not hit
    there; with every page written it does."""
    prompt = list(range(40))
    hits = {}
    for swa_from in (0, 32):
        c = KVCache(cfg(retention=retention))
        assert c.admit("remote", prompt, c.match(prompt), 6, swa_from=swa_from).ok
        assert c.reserve("remote", 40)
        c.commit("remote", 40, [1])
        c.finish("remote")
        c.check_invariants()
        hit = c.match(prompt)
        hits[swa_from] = hit.tokens
        c.release_hit(hit)
    assert hits == {0: 36, 32: 0}
    with pytest.raises(ValueError, match="page aligned"):
        KVCache(cfg()).admit("x", prompt, KVCache(cfg()).match(prompt), 6, swa_from=30)


def test_whole_sequence_reuse_hits_prompt_plus_output() -> None:
    o = Oracle(KVCache(audit_tokens=True, config=cfg()))
    serve(o, "t1", list(range(21)), max_new=8)
    full_tokens = list(range(21))
    # Rebuild the sampled tokens the oracle engine appended (deterministic in seq id and length).
    from tests.fixtures.kvcache_oracle import hash_free_token
    for n in range(21, 29):
        full_tokens.append(10_000_000 + 7919 * n % 9973 + hash_free_token("t1", n))
    assert serve(o, "t2", full_tokens[:28] + [1, 2, 3]) == 28


def test_lru_refresh_does_not_keep_out_of_window_ancestors_swa_hot() -> None:
    """A hit refreshes SWA recency only where its window is; the stem's own checkpoint ages out first."""
    c = KVCache(audit_tokens=True, config=cfg(retention="checkpoints", num_swa_pages=6, checkpoint_align=8))
    o = Oracle(c)
    stem = list(range(16))
    serve(o, "s", stem + [1])  # checkpoint at 16 (turn boundary) -> SWA pages 2, 3
    serve(o, "x", stem + list(range(50, 66)) + [2])  # checkpoints at 32
    for _ in range(3):
        assert serve(o, "y", stem + list(range(50, 66)) + [3]) == 32  # hits at 32, never touching 16's window
    serve(o, "z", list(range(900, 917)))  # needs SWA pages: evicts the coldest checkpoint
    assert c.match(stem + [9]).tokens == 0  # stem's window went first
    assert c.match(stem + list(range(50, 66)) + [9]).tokens == 32


def test_full_eviction_takes_least_recently_used_unlocked_leaf() -> None:
    c = KVCache(audit_tokens=True, config=cfg(num_full_pages=12, num_swa_pages=16))
    o = Oracle(c)
    serve(o, "a", list(range(100, 117)))
    serve(o, "b", list(range(200, 217)))
    assert serve(o, "a2", list(range(100, 117)) + [5]) == 16  # touch a
    serve(o, "c", list(range(300, 317)))  # needs 5 pages: b is the LRU leaf
    assert c.match(list(range(200, 217))).tokens == 0
    assert c.match(list(range(100, 117))).tokens == 16


def test_disabled_prefix_cache_never_hits_nor_inserts() -> None:
    o = Oracle(KVCache(audit_tokens=True, config=cfg(enable_prefix_cache=False)))
    serve(o, "a", list(range(20)))
    assert o.cache.match(list(range(20))).tokens == 0
    assert o.cache.usage().full.cached == 0 and o.cache.drain_events() == []


def test_abort_frees_everything_and_inserts_nothing() -> None:
    c = KVCache(audit_tokens=True, config=cfg())
    o = Oracle(c)
    tokens = list(range(30))
    assert c.admit("a", tokens, c.match(tokens), 3).ok
    o.running["a"] = Running(tokens, 30, 3)
    assert o.step("a", 12)
    c.abort("a")
    u = c.usage()
    assert u.full.free == 64 and u.swa.free == 32 and u.full.reserved == 0
    c.check_invariants()


# ---------------------------------------------------------------- host tier


def test_backup_evict_and_load_back_moves_full_pages_and_live_swa_only() -> None:
    c = KVCache(audit_tokens=True, config=cfg(retention="none", num_full_pages=10, num_swa_pages=8,
                                              num_host_full_pages=16, num_host_swa_pages=8))
    o = Oracle(c)
    a = list(range(33))
    serve(o, "a", a)  # 8 full pages, SWA on pages 6, 7 only
    copies = c.backup_to_host(100)
    assert sorted((p.group, p.direction) for p in copies).count(("full", "d2h")) == 8
    assert sum(p.group == "swa" for p in copies) == 2  # the SWA mask: live pages only
    o.run_copies(copies)
    serve(o, "b", list(range(500, 521)))  # needs 6 full pages -> "a" goes to host
    assert c.usage().full.cached < 8
    hit = c.match(a)
    assert hit.tokens == 32 and hit.host_tokens > 0
    assert all(p.direction == "h2d" for p in hit.load_copies)
    assert sum(p.group == "swa" for p in hit.load_copies) == 2
    o.check_hit(a, hit)  # executes the loads, then checks every page's content
    c.check_invariants()
    c.release_hit(hit)
    kinds = {(e.kind, e.tier) for e in c.drain_events()}
    assert {(EventKind.STORED, Tier.HOST), (EventKind.REMOVED, Tier.DEVICE), (EventKind.STORED, Tier.DEVICE)} <= kinds


# ---------------------------------------------------------------- events


def test_events_carry_block_hashes_and_checkpoint_flags() -> None:
    c = KVCache(audit_tokens=True, config=cfg(retention="none", num_full_pages=10, num_swa_pages=6))
    o = Oracle(c)
    a = list(range(25))
    serve(o, "a", a)
    (ev,) = c.drain_events()
    assert ev.kind is EventKind.STORED and ev.tier is Tier.DEVICE and ev.parent_hash is None
    assert list(ev.block_hashes) == block_hashes(a, 4)
    assert ev.swa_checkpoint == (False,) * 5 + (True,)  # only the end has a full window of SWA
    serve(o, "b", list(range(300, 337)))  # evicts "a"
    removed = [e for e in c.drain_events() if e.kind is EventKind.REMOVED]
    assert removed and removed[0].block_hashes == ev.block_hashes


def test_caller_block_hashes_give_the_same_events_as_hashing_in_the_cache() -> None:
    tokens = list(range(500, 530))
    out = []
    for given in (None, block_hashes(tokens, 4)):
        c = KVCache(audit_tokens=True, config=cfg())
        hit = c.match(tokens)
        assert c.admit("a", tokens, hit, 0, block_hashes=given).ok
        assert c.reserve("a", 30)
        c.commit("a", 30)
        c.finish("a")
        c.check_invariants()  # verifies every node's hashes chain from its parent
        out.append([e.block_hashes for e in c.drain_events()])
    assert out[0] == out[1] and sum(len(h) for h in out[0]) == 7


# ---------------------------------------------------------------- hash-keyed tree, learned checkpoint kinds


def test_match_with_caller_hashes_equals_match_hashing_itself() -> None:
    o = Oracle(KVCache(audit_tokens=True, config=cfg()))
    a = list(range(40))
    serve(o, "a", a, max_new=3)
    c = o.cache
    for probe in (a + [1], a[:30] + [7] * 9, [5] * 20):
        mine, theirs = c.match(probe), c.match(probe, block_hashes=block_hashes(probe, 4))
        assert (mine.tokens, mine.raw_tokens, mine.full_pages) == (theirs.tokens, theirs.raw_tokens,
                                                                   theirs.full_pages)
        c.release_hit(mine)
        c.release_hit(theirs)
    wrong = c.match(a + [1], block_hashes=block_hashes(a + [1], 4, seed=99))  # another chain: nothing shared
    assert wrong.tokens == 0 and wrong.raw_tokens == 0


def test_invariants_catch_caller_hashes_that_are_not_the_tokens_chain() -> None:
    c = KVCache(audit_tokens=True, config=cfg())
    tokens = list(range(600, 620))
    bad = block_hashes(tokens, 4)
    bad[2] ^= 1
    assert c.admit("a", tokens, c.match(tokens), 0, block_hashes=bad).ok
    assert c.reserve("a", 20)
    c.commit("a", 20)
    c.finish("a")
    with pytest.raises(AssertionError, match="does not chain"):
        c.check_invariants()


def test_swa_eviction_of_a_leaf_sends_removed_only_and_of_an_inner_node_swa_removed() -> None:
    c = KVCache(audit_tokens=True, config=cfg(retention="none", num_swa_pages=4))
    o = Oracle(c)
    a = list(range(17))
    serve(o, "a", a)  # a leaf holding its end window (2 SWA pages)
    (stored,) = c.drain_events()
    serve(o, "b", list(range(900, 917)))  # needs 3 SWA pages: a's window goes, a becomes a tombstone leaf
    kinds = [(e.kind, e.block_hashes) for e in c.drain_events()]
    assert (EventKind.REMOVED, stored.block_hashes) in kinds and EventKind.SWA_REMOVED not in dict(kinds)
    assert c.match(a + [1]).raw_tokens == 0  # its full pages left the tree with it

    c = KVCache(audit_tokens=True, config=cfg(retention="checkpoints", checkpoint_align=8, num_swa_pages=6))
    o = Oracle(c)
    stem = list(range(16))
    serve(o, "s", stem + [1])  # turn checkpoint at 16 (an inner node once "x" extends it)
    serve(o, "x", stem + list(range(50, 66)) + [2])
    c.drain_events()
    serve(o, "z", list(range(900, 917)))  # needs SWA: evicts the oldest checkpoint, the stem's
    dropped = [e for e in c.drain_events() if e.kind is EventKind.SWA_REMOVED]
    assert dropped and dropped[0].block_hashes == tuple(block_hashes(stem, 4)[-2:])  # the stem's window node
    assert c.match(stem + [9]).tokens == 0 and c.match(stem + [9]).raw_tokens == 16


def test_kinds_nobody_reuses_turn_cold_and_their_checkpoints_go_first() -> None:
    """Each conversation's follow-up shares only the first prompt's whole blocks (the trace's shape): the turn
    checkpoint is reused, the end-of-sequence and page-aligned prompt-end ones never. With a small SWA pool,
    plain LRU would have evicted an old turn checkpoint long before the last conversation; cold-first keeps it."""
    c = KVCache(audit_tokens=True, config=cfg(page_size=4, window=4, num_full_pages=600, num_swa_pages=40,
                                               checkpoint_align=8))
    o = Oracle(c)
    for i in range(40):
        first = [i * 1000 + j for j in range(16)] + [i * 1000 + 500 + j for j in range(6)]
        serve(o, f"a{i}", first, max_new=6)  # checkpoints: turn 16, prompt end 20, end 24
        assert serve(o, f"b{i}", first[:16] + [i * 1000 + 700 + j for j in range(5)]) == 16
    stats = c.checkpoint_stats()
    assert stats["turn"][1] > 0 and not stats["turn"][2]
    assert stats["end"][2] and stats["prompt_end"][2] and stats["end"][1] == 0
    probe = [20 * 1000 + j for j in range(16)] + [1, 2, 3]
    assert c.match(probe).tokens == 16  # conversation 20's turn checkpoint outlived 19 newer conversations


def test_lazy_checkpoint_pages_are_cached_memory_reclaimed_before_they_crowd_a_new_sequence() -> None:
    """Cold (here speculative periodic) checkpoint pages that left the window are kept while SWA memory is spare,
    count as cached, not as the sequence's usage, and are taken back when another sequence needs SWA pages; the
    running sequence's own window is untouched (the oracle checks every read) and whole windows left at finish
    still serve hits."""
    c = KVCache(audit_tokens=True, config=cfg(num_swa_pages=10, checkpoint_every_pages=2))
    o = Oracle(c)
    a = list(range(1000, 1042))
    assert c.admit("a", a, c.match(a), 0).ok
    o.running["a"] = Running(list(a), len(a), 0)
    while c.num_computed("a") < 36:
        assert o.step("a", 4)
        c.check_invariants()
    lazy = c.usage().swa.cached
    assert lazy > 0 and c.usage().swa.in_use <= c.cfg.seq_swa_pages  # kept pages are cache, not a's usage
    b = list(range(5000, 5024))
    assert c.admit("b", b, c.match(b), 0).ok  # the lazy pages count as available memory
    o.running["b"] = Running(list(b), len(b), 0)
    while c.num_computed("b") < len(b):
        assert o.step("b", 4)
        c.check_invariants()
    assert c.usage().swa.cached < lazy  # b's pages came from a's lazy pages
    while c.num_computed("a") < len(a):
        assert o.step("a", 2)  # a's window was never taken
        c.check_invariants()
    for sid in ("a", "b"):
        o.running.pop(sid)
        c.finish(sid)
        c.check_invariants()
    assert c.usage().swa.in_use == 0 and c.usage().swa.reserved == 0
    hit = c.match(a[:40] + [7])
    o.check_hit(a[:40] + [7], hit)
    assert hit.tokens == 40  # the end window survives whatever was reclaimed
    c.release_hit(hit)


# ---------------------------------------------------------------- SWA window rebuild from cached full KV


def rebuild_cfg(**kw: object) -> KVCacheConfig:
    """window 4, page 4; S = 16 = (3 SWA layers + 1) windows: the oracle's model gets exact SWA KV from R + 8."""
    base: dict[str, object] = dict(window=4, rebuild_tokens=16, retention="none")
    base.update(kw)
    return cfg(**base)


def test_rebuild_hit_where_a_checkpoint_only_cache_falls_back() -> None:
    a = list(range(40))
    b = a[:32] + [900 + i for i in range(5)]  # full KV of a[:32] cached, SWA only at a's end (page 9)
    plain = Oracle(KVCache(audit_tokens=True, config=rebuild_cfg(rebuild_tokens=0)))
    serve(plain, "a", a)
    assert plain.cache.match(b).tokens == 0
    o = Oracle(KVCache(audit_tokens=True, config=rebuild_cfg()))
    serve(o, "a", a)
    hit = o.cache.match(b)
    o.check_hit(b, hit)
    assert (hit.tokens, hit.full_tokens, hit.raw_tokens) == (16, 32, 32) and hit.is_rebuild
    assert hit.full_pages == o.cache.match(a + [1]).full_pages[:8]  # the cached pages, not new ones
    assert set(hit.swa_pages) == {-1}
    o.cache.release_hit(hit)
    assert serve(o, "b", b) == 16  # the oracle engine checks every span read: full < 32 cached, SWA >= 16
    st = o.cache.rebuild_stats()
    assert (st.matched, st.admitted, st.rebuilt_tokens) == (2, 1, 16)


def test_no_rebuild_when_it_skips_no_more_than_the_valid_hit() -> None:
    a = list(range(40))
    b = a[:32] + [900 + i for i in range(5)]
    for s_tokens, want in ((16, (16, 16)), (12, (20, 32))):  # valid hit 16; R = 32 - S
        o = Oracle(KVCache(audit_tokens=True, config=rebuild_cfg(rebuild_tokens=s_tokens)))
        serve(o, "t", a[:17])  # its end window: a valid hit at 16
        serve(o, "a", a)
        hit = o.cache.match(b)
        o.check_hit(b, hit)
        assert (hit.tokens, hit.full_tokens) == want, s_tokens
        o.cache.release_hit(hit)
        o.cache.check_invariants()


def test_abort_mid_span_leaks_nothing_and_leaves_the_tree_as_it_was() -> None:
    o = Oracle(KVCache(audit_tokens=True, config=rebuild_cfg()))
    a = list(range(40))
    serve(o, "a", a)
    b = a[:32] + [900 + i for i in range(5)]
    before = o.cache.usage()
    hit = o.cache.match(b)
    assert o.admit("b", b, hit, 4).ok
    assert o.step("b", 4) and o.step("b", 6) and o.step("b", 4)  # at 30: holds SWA pages 6, 7 (exact) + window
    o.cache.check_invariants()
    full, swa = o.cache.page_tables("b")
    assert full == list(hit.full_pages) and [j for j, s in enumerate(swa) if s >= 0] == [6, 7]
    o.cache.abort("b")
    o.running.pop("b")
    o.cache.check_invariants()
    after = o.cache.usage()
    assert (after.full, after.swa) == (before.full, before.swa)
    again = o.cache.match(b)
    assert (again.tokens, again.full_tokens, again.full_pages) == (16, 32, hit.full_pages)


def test_finish_after_a_rebuild_heals_the_tombstone_so_the_next_request_hits_there() -> None:
    o = Oracle(KVCache(audit_tokens=True, config=rebuild_cfg(retention="checkpoints")))
    a = list(range(40))
    serve(o, "a", a)
    b = a[:32] + [900 + i for i in range(13)]
    assert serve(o, "b", b, max_new=3) == 16  # rebuild: the branch checkpoint at 32 keeps its window (page 7)
    again = o.cache.match(b)
    o.check_hit(b, again)
    assert not again.is_rebuild and again.tokens >= 32
    o.cache.release_hit(again)
    c = a[:32] + [700 + i for i in range(3)]  # another continuation: a normal valid hit at the healed point
    hit = o.cache.match(c)
    o.check_hit(c, hit)
    assert (hit.tokens, hit.full_tokens) == (32, 32)
    o.cache.release_hit(hit)


@pytest.mark.parametrize("kw, probe_at", [
    (dict(retention="checkpoints", checkpoint_align=20), 20),  # a turn checkpoint at 20 lies inside the span
    (dict(retention="all", num_swa_pages=14), 24),  # "all" would keep every span page
])
def test_scratch_swa_of_a_rebuild_span_is_never_retained(kw: dict[str, object], probe_at: int) -> None:
    """R = 16 for a branch at E = 32: SWA KV of [16, 24) is scratch (missing context before R). A hit ending
    where its window reads it must not become valid; the oracle fails any read of scratch KV."""
    o = Oracle(KVCache(audit_tokens=True, config=rebuild_cfg(**kw)))
    a = list(range(40))
    serve(o, "a", a)
    if kw["retention"] == "all":  # drop a's SWA (keep its full KV): an extension, then an unrelated request
        serve(o, "a2", a + list(range(40, 48)))
        serve(o, "d", list(range(500, 520)))
    b = a[:32] + [900 + i for i in range(5)]  # the turn checkpoint: 37 // 20 * 20 = 20
    assert serve(o, "b", b) == 16
    probe = a[:probe_at] + [1, 2, 3]
    hit = o.cache.match(probe)
    o.check_hit(probe, hit)
    assert hit.tokens < probe_at or hit.is_rebuild
    o.cache.release_hit(hit)


def test_rebuild_hit_brings_host_full_pages_back() -> None:
    o = Oracle(KVCache(audit_tokens=True, config=rebuild_cfg(num_full_pages=12, num_swa_pages=8,
                                                              num_host_full_pages=16, num_host_swa_pages=8)))
    a = list(range(41))
    serve(o, "a", a)  # 10 full pages
    o.run_copies(o.cache.backup_to_host(100))
    serve(o, "x", list(range(500, 521)))  # needs 6 full pages: a goes to the host tier
    b = a[:36] + [900 + i for i in range(5)]
    hit = o.cache.match(b)
    assert hit.is_rebuild and (hit.tokens, hit.full_tokens) == (20, 36) and hit.host_tokens > 0
    assert {(c.group, c.direction) for c in hit.load_copies} >= {("full", "h2d")}
    o.check_hit(b, hit)  # executes the loads, then checks the full KV of [0, 36)
    assert o.admit("b", b, hit, 0).ok
    while o.cache.num_computed("b") < len(b):
        assert o.step("b", 3)
        o.cache.check_invariants()
    o.running.pop("b")
    o.cache.finish("b")
    o.cache.check_invariants()


def test_rebuild_span_is_swa_layers_plus_one_windows_in_whole_pages():
    assert rebuild_span(60, 128, 64) == 61 * 128  # MiMo-V2.5-Pro: 7808, already page aligned
    assert rebuild_span(4, 16, 12) == 84  # 80 tokens rounded up to pages of 12
    assert rebuild_span(4, 16, 32) == 0  # a page longer than the window: no rebuild
    assert rebuild_span(0, 16, 4) == 0  # no SWA layers: nothing to rebuild
    KVCacheConfig(page_size=4, window=16, num_full_pages=8, num_swa_pages=8, rebuild_tokens=rebuild_span(4, 16, 4))
