"""Property tests: random interleavings of cache operations, invariants after every step, every hit and every
forward read checked against the brute-force oracle (tests/fixtures/kvcache_oracle.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.kvcache import KVCache, KVCacheConfig, PrefixHit
from tests.fixtures.kvcache_oracle import Oracle, Running, tree_reference

pytestmark = pytest.mark.unit

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

CONFIGS = st.builds(
    lambda host, **kw: KVCacheConfig(num_host_full_pages=host, num_host_swa_pages=host // 2, **kw),
    host=st.sampled_from([0, 24]),
    page_size=st.sampled_from([4]),
    window=st.sampled_from([4, 6, 8]),
    num_full_pages=st.integers(24, 60),
    num_swa_pages=st.integers(8, 24),
    retention=st.sampled_from(["checkpoints", "none", "all"]),
    checkpoint_align=st.sampled_from([0, 8]),
    checkpoint_every_pages=st.sampled_from([0, 1, 3]),  # 1: many lazy pages, reclaimed under pressure
)

OPS = st.lists(st.tuples(st.sampled_from(["start", "turn", "step", "run", "run", "finish", "finish", "abort",
                                          "backup", "probe"]),
                         st.integers(0, 1 << 16)), min_size=5, max_size=60)


def _prompt(r: int, history: list[list[int]]) -> list[int]:
    """Prompts from three families sharing stems, so matches, branches and tombstones happen."""
    family, stem, tail = r % 3, (r >> 2) % 4, (r >> 4) % 5
    base = [family * 1000 + i for i in range(6 + 4 * stem)]
    return base + [50_000 + r % 97 * 100 + i for i in range(1 + tail * 3)]


def _long_prompt(r: int, history: list[list[int]]) -> list[int]:
    """Longer stems (24-48 tokens) than `_prompt`, so branches sit a rebuild span past the last checkpoint."""
    family, stem, tail = r % 3, (r >> 2) % 4, (r >> 4) % 5
    base = [family * 1000 + i for i in range(24 + 8 * stem)]
    return base + [50_000 + r % 97 * 100 + i for i in range(1 + tail * 3)]


def _apply(o: Oracle, op: str, r: int, history: list[list[int]], names: list[str],
           prompt: Callable[[int, list[list[int]]], list[int]] = _prompt) -> None:
    cache = o.cache
    ids = sorted(o.running)
    if not ids and op in ("step", "run", "finish", "abort"):
        op = "turn" if r % 2 else "start"
    if op in ("start", "turn", "probe", "branch", "serve", "bserve"):
        if op == "turn" and history:
            prev = history[r % len(history)]
            tokens = prev + [70_000 + r % 11 + i for i in range(1 + r % 6)]
        elif op in ("branch", "bserve") and history:
            # leaves an earlier sequence at a page boundary: full KV, no checkpoint
            prev = history[r % len(history)]
            cut = (r >> 3) % (len(prev) // cache.cfg.page_size + 1) * cache.cfg.page_size
            tokens = prev[:cut] + [80_000 + r % 13 * 10 + i for i in range(1 + r % 7)]
        else:
            tokens = prompt(r, history)
        full_ref, valid_ref = tree_reference(cache, tokens)
        hit = cache.match(tokens)
        cache.check_invariants()
        o.check_hit(tokens, hit)
        _check_against_reference(cache.cfg, tokens, hit, full_ref, valid_ref)
        if op == "probe":
            cache.release_hit(hit)
            return
        sid = f"s{len(names)}"
        names.append(sid)
        res = o.admit(sid, tokens, hit, r % 5)
        if not res.ok:
            assert res.reason and any(f"{p} pool" in res.reason for p in ("full", "swa", "arena"))
        elif op in ("serve", "bserve"):  # the whole request at once: the tree fills with what later ops share
            _run_to_end(o, sid, 1 + r % 6)
            if cache.num_computed(sid) == len(o.running[sid].tokens):
                run = o.running.pop(sid)
                cache.finish(sid)
                history.append(run.tokens[:cache.cfg.page_size * (len(run.tokens) // cache.cfg.page_size)])
    elif op == "step" and ids:
        _run_to_end(o, ids[r % len(ids)], 1 + r % 6, max_steps=1)
    elif op == "run" and ids:
        _run_to_end(o, ids[r % len(ids)], 1 + r % 6)
    elif op in ("finish", "abort") and ids:
        done = [s for s in ids if cache.num_computed(s) == len(o.running[s].tokens)]
        sid = done[r % len(done)] if done and r % 5 else ids[r % len(ids)]
        run = o.running.pop(sid)
        if op == "finish":
            cache.finish(sid, cache=r % 4 != 0)
            history.append(run.tokens[:cache.cfg.page_size * (len(run.tokens) // cache.cfg.page_size)])
        else:
            cache.abort(sid)
    elif op == "backup":
        o.run_copies(cache.backup_to_host(1 + r % 12))


def _run_to_end(o: Oracle, sid: str, chunk: int, max_steps: int = 1 << 30) -> None:
    """Prefill/decode steps of `chunk` tokens (up to 6: crosses pages, not always aligned), 1 if refused."""
    run = o.running[sid]
    while max_steps and (left := len(run.tokens) - o.cache.num_computed(sid)) > 0:
        if not o.step(sid, min(left, chunk)) and not o.step(sid, 1):
            break
        o.cache.check_invariants()
        max_steps -= 1


def _check_against_reference(cfg: KVCacheConfig, tokens: list[int], hit: PrefixHit, full_ref: int,
                             valid_ref: int) -> None:
    """A normal hit is never past the brute-force longest valid hit (memory may make it shorter); a rebuild hit
    ends inside the cached full KV, recomputes exactly rebuild_tokens and skips more than any valid hit."""
    limit = (len(tokens) - 1) // cfg.page_size * cfg.page_size
    if not hit.is_rebuild:
        assert hit.tokens <= valid_ref, (hit.tokens, valid_ref)
        return
    assert cfg.rebuild_tokens > 0, "rebuild hit with rebuilds off"
    assert hit.full_tokens <= min(full_ref, limit), (hit.full_tokens, full_ref)
    assert hit.full_tokens - hit.tokens == cfg.rebuild_tokens
    assert hit.tokens > valid_ref, (hit.tokens, valid_ref)


def _run(o: Oracle, ops: list[tuple[str, int]],
         prompt: Callable[[int, list[list[int]]], list[int]] = _prompt) -> None:
    """Apply the ops with invariants after each; at the end finish everything and check nothing leaked."""
    cfg = o.cache.cfg
    history: list[list[int]] = []
    names: list[str] = []
    for op, r in ops:
        _apply(o, op, r, history, names, prompt)
        o.cache.check_invariants()
        if not cfg.retention == "all":
            for sid in o.running:
                full, swa = o.cache.page_tables(sid)
                held = sum(1 for j, s in enumerate(swa) if s >= 0 and j not in o.cache._seqs[sid].keep)
                assert held <= cfg.seq_swa_pages + 1
    for sid in sorted(o.running):
        o.cache.finish(sid)
        o.cache.check_invariants()
    u = o.cache.usage()
    assert u.full.in_use == 0 and u.swa.in_use == 0 and u.full.reserved == 0 and u.swa.reserved == 0


@SETTINGS
@given(cfg=CONFIGS, ops=OPS)
def test_random_interleavings_keep_invariants_and_hits_valid(cfg: KVCacheConfig, ops: list[tuple[str, int]]) -> None:
    _run(Oracle(KVCache(audit_tokens=True, config=cfg)), ops)


REBUILD_CONFIGS = st.builds(
    lambda host, window, layers, **kw: KVCacheConfig(
        num_host_full_pages=host, num_host_swa_pages=host // 2, window=window,
        rebuild_tokens=-(-(layers + 1) * window // 4) * 4, **kw),
    host=st.sampled_from([0, 24]),
    page_size=st.sampled_from([4]),
    window=st.sampled_from([4, 6, 8]),
    layers=st.integers(1, 3),  # SWA layers of the model: S = (layers + 1) windows, rounded up to pages
    num_full_pages=st.integers(32, 96),
    num_swa_pages=st.integers(8, 24),
    retention=st.sampled_from(["checkpoints", "none", "all"]),
    checkpoint_align=st.sampled_from([0, 8]),
    checkpoint_every_pages=st.sampled_from([0, 0, 3]),
)

REBUILD_OPS = st.lists(st.tuples(st.sampled_from(["start", "serve", "serve", "turn", "branch", "bserve", "bserve",
                                                  "step", "run", "finish", "abort", "backup", "backup",
                                                  "probe"]),
                                 st.integers(0, 1 << 16)), min_size=5, max_size=60)


@SETTINGS
@given(cfg=REBUILD_CONFIGS, ops=REBUILD_OPS)
def test_rebuild_hits_read_only_cached_full_kv_and_their_own_window(cfg: KVCacheConfig,
                                                                   ops: list[tuple[str, int]]) -> None:
    """Random interleavings with SWA window rebuilds on: every rebuild hit is checked against the brute-force tree
    reference (full KV below E, R > any valid hit), every span read by the oracle engine (full < E cached, SWA
    >= R in the window), and scratch SWA KV of a span must never be read by a later hit."""
    _run(Oracle(KVCache(audit_tokens=True, config=cfg)), ops, _long_prompt)


ARENA_SETTINGS = settings(SETTINGS, max_examples=150)

ARENA_CONFIGS = st.builds(
    lambda host, window, layers, **kw: KVCacheConfig(
        num_host_full_pages=host if host > 0 else 0, num_host_swa_pages=host // 2 if host > 0 else 0,
        host_arena_units=max(0, -host), window=window, num_full_pages=0, num_swa_pages=0,
        rebuild_tokens=-(-(layers + 1) * window // 4) * 4 if layers else 0, **kw),
    host=st.sampled_from([0, 24, -40, -90]),  # < 0: one host arena of -host units (> 0: two host pools)
    page_size=st.sampled_from([4]),
    window=st.sampled_from([4, 6, 8]),
    layers=st.sampled_from([0, 1, 3]),  # 0: no rebuilds; else S = (layers + 1) windows (tombstone leaves kept)
    arena_units=st.integers(30, 100),
    full_page_units=st.sampled_from([1, 2]),
    swa_page_units=st.sampled_from([1, 3, 6]),  # MiMo: an SWA page is 6 full pages' bytes
    retention=st.sampled_from(["checkpoints", "none", "all"]),
    checkpoint_align=st.sampled_from([0, 8]),
    checkpoint_every_pages=st.sampled_from([0, 1, 3]),
)


@ARENA_SETTINGS
@given(cfg=ARENA_CONFIGS, ops=REBUILD_OPS)
def test_arena_interleavings_keep_invariants_and_hits_valid(cfg: KVCacheConfig, ops: list[tuple[str, int]]) -> None:
    """Both groups on one arena: the interleavings of the tests above (with and without rebuilds), with units
    free + cached + in use == arena and promises within free + cached after every step (the ledger's audit),
    SWA per running sequence <= window + page, every hit and read checked by the oracle, nothing leaked."""
    o = Oracle(KVCache(audit_tokens=True, config=cfg))
    _run(o, ops, _long_prompt if cfg.rebuild_tokens else _prompt)
    u = o.cache.usage()
    a = u.arena
    assert a is not None and a.full_in_use == a.swa_in_use == a.reserved == 0
    assert a.free + a.full_cached + a.swa_cached == a.units == cfg.arena_units
    h = u.host_arena
    assert (h is not None) == (cfg.host_arena_units > 0)
    if h is not None:
        assert h.full_in_use == h.swa_in_use == 0 and h.free + h.full_cached + h.swa_cached == h.units == (
            cfg.host_arena_units)


def _oracle_hit(tokens: list[int], cached: list[tuple[list[int], set[int]]], P: int, wp: int) -> tuple[int, int]:
    """Brute force: per page of `tokens`, does any cached sequence with the same prefix hold full / SWA KV?
    (longest valid hit, longest full-KV prefix), both page aligned and < len(tokens)."""
    best = full_end = 0
    for end in range(1, (len(tokens) - 1) // P + 1):
        full = any(len(t) >= end * P and t[:end * P] == tokens[:end * P] for t, _ in cached)
        swa = all(any(len(t) >= (j + 1) * P and t[:(j + 1) * P] == tokens[:(j + 1) * P] and j in s
                      for t, s in cached) for j in range(max(0, end - wp), end))
        full_end = end * P if full else full_end
        if full and swa:
            best = end * P
    return best, full_end


@SETTINGS
@given(retention=st.sampled_from(["none", "all"]), window=st.sampled_from([4, 8, 12]),
       rebuild_windows=st.sampled_from([0, 2, 3]),
       prompts=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(0, 5)), min_size=2,
                        max_size=12))
def test_hits_are_maximal_with_unlimited_memory(retention: str, window: int, rebuild_windows: int,
                                                prompts: list[tuple[int, int, int]]) -> None:
    """With no memory pressure the hit must equal the brute-force longest valid prefix, or, with rebuilds on,
    the rebuild hit at the end of the full-KV prefix when that skips more (R = E - S > valid)."""
    P = 4
    S = -(-rebuild_windows * window // P) * P
    cfg = KVCacheConfig(page_size=P, window=window, num_full_pages=4096, num_swa_pages=4096, retention=retention,
                        rebuild_tokens=S)
    o = Oracle(KVCache(audit_tokens=True, config=cfg))
    cached: list[tuple[list[int], set[int]]] = []
    for i, (stem, n, extra) in enumerate(prompts):
        tokens = [stem * 100 + j for j in range(n)] + [9000 + i] * extra
        if not tokens:
            continue
        hit = o.cache.match(tokens)
        o.check_hit(tokens, hit)
        valid, full_end = _oracle_hit(tokens, cached, P, cfg.window_pages)
        want = (full_end - S, full_end) if S and full_end - S > valid else (valid, valid)
        assert (hit.tokens, hit.full_tokens) == want, (tokens, hit)
        sid = f"q{i}"
        assert o.admit(sid, tokens, hit, 0).ok
        while o.cache.num_computed(sid) < len(tokens):
            assert o.step(sid, min(P, len(tokens) - o.cache.num_computed(sid)))
        o.cache.finish(sid)
        o.cache.check_invariants()
        npg = len(tokens) // P
        swa = set(range(npg)) if retention == "all" else set(range(max(0, npg - cfg.window_pages), npg))
        cached.append((tokens[:npg * P], swa))


@SETTINGS
@given(window=st.sampled_from([4, 8]), spare=st.integers(0, 6),
       lens=st.lists(st.integers(12, 40), min_size=2, max_size=4),
       steps=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), min_size=10, max_size=80))
def test_lazy_checkpoint_pages_yield_to_running_sequences(window: int, spare: int, lens: list[int],
                                                          steps: list[tuple[int, int]]) -> None:
    """Sequences that keep a (speculative) checkpoint at every page, in an SWA pool with little room beyond their
    windows: the lazily kept pages fill the spare room and are taken back whenever a running sequence needs a
    page. Every read is checked by the oracle, invariants after every step, nothing leaks at the end."""
    P = 4
    need = len(lens) * (-(-window // P) + 1)
    cfg = KVCacheConfig(page_size=P, window=window, num_full_pages=64, num_swa_pages=need + spare,
                        checkpoint_every_pages=1)
    o = Oracle(KVCache(audit_tokens=True, config=cfg))
    admitted = 0

    def admit_next() -> None:
        nonlocal admitted
        tokens = [admitted * 1000 + j for j in range(lens[admitted])]
        assert o.cache.admit(f"s{admitted}", tokens, o.cache.match(tokens), 0).ok  # lazy pages count as free
        o.running[f"s{admitted}"] = Running(tokens, len(tokens), 0)
        admitted += 1

    admit_next()
    for who, k in steps:
        if who == 3 and admitted < len(lens):  # arrives while lazy pages hold the spare room
            admit_next()
        sid = f"s{who % admitted}"
        left = len(o.running[sid].tokens) - o.cache.num_computed(sid)
        if left:
            assert o.step(sid, min(k, left, P - o.cache.num_computed(sid) % P))  # inside the promise
        o.cache.check_invariants()
    for sid in sorted(o.running):
        o.cache.finish(sid)
        o.cache.check_invariants()
    u = o.cache.usage()
    assert u.swa.in_use == 0 and u.swa.reserved == 0 and u.swa.free + u.swa.cached == u.swa.capacity
