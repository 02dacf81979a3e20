"""GCache (L3) in the engine: the import / export bookkeeping of libs/kvcache (pure), and with the real tiny
model and real engines: prefixes that come from L3 (alone, or after local L1 pages) give the outputs of a
cache-disabled run, a hanging store is a miss after the lookup bound, a full write-back queue drops without
stalling decoding, and two combined workers over a real nats-server share one store
(docs/kvcache.md, "Engine integration (L3)")."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Sequence

import pytest
import torch

from libs.engine import AsyncEngine, EngineCore, Request, SamplingParams
from libs.engine.gcache_tier import kv_layout, l3_namespace
from libs.gcache.api import Buffer
from libs.gcache.memory import MemoryBlockStore
from libs.kvcache import KVCache, KVCacheConfig, l3_checkpoint_ends, l3_checkpoints, l3_footprint, l3_hit_end
from libs.model import load_model, load_tokenizer
from libs.worker.gcache import GCacheLink
from tests.test_engine import PAGE
from tests.test_engine import make_core as engine_core

# PAGE = 4 (tests/test_engine.py): the tiny model's window is 16, 4 pages per checkpoint


def tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


# ------------------------------------------------------------------------------------------ pure
@pytest.mark.unit
def test_l3_hit_end_takes_the_longest_run_whose_checkpoint_window_lies_in_the_import() -> None:
    full = [True] * 10
    swa = [False] * 10
    swa[3] = swa[7] = True
    assert l3_hit_end(0, full, swa, 2, 10) == 8
    assert l3_hit_end(0, full, swa, 2, 7) == 4  # a hit stays below the prompt's last token
    assert l3_hit_end(6, full, swa, 2, 10) == 8  # window [6, 8) starts at the local end: fine
    assert l3_hit_end(7, full, swa, 2, 10) == 0  # window [6, 8) reaches into local pages: refused
    full[5] = False
    assert l3_hit_end(0, full, swa, 2, 10) == 4  # the full values must be contiguous from the local end
    assert l3_hit_end(6, full, swa, 2, 10) == 8
    assert l3_hit_end(0, [True], [True], 4, 1) == 1  # a window clamped at page 0


@pytest.mark.unit
def test_l3_footprint_is_the_dual_layout_limit_when_the_window_is_whole_pages() -> None:
    layout = kv_layout(load_model(None)[1], torch.bfloat16)
    stored, limit = l3_footprint(layout, 4, 16, 100, [49, 99])
    assert stored == limit == (100 * 4 * layout.full_layers * layout.full_bytes_per_token_layer
                               + 2 * 16 * layout.swa_layers * layout.swa_bytes_per_token_layer)
    stored, limit = l3_footprint(layout, 4, 14, 100, [99])  # 14 tokens round up to 4 pages = 16
    assert stored - limit == 2 * layout.swa_layers * layout.swa_bytes_per_token_layer


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_round_trip_from_device_pages_to_host_pages(dtype) -> None:
    """Write-back bytes of some pages, staged and written into other host pages, are those pages' K and V."""
    from libs.engine.gcache_tier import (
        KnownBlocks,
        L3Export,
        ValueLayout,
        WriteBack,
        stage_values,
        write_host_blocks,
    )
    from libs.model.paged import KVPools

    cfg = load_model(None)[1]
    dev, host = (KVPools.allocate(cfg, 8, 8, PAGE, dtype) for _ in range(2))
    for t in (dev.full_k, dev.full_v, dev.swa_k, dev.swa_v):
        t.copy_(torch.randn(t.shape))
    layout = ValueLayout.of(dev, 4)
    jobs: list[WriteBack] = []

    class Cache:  # the two things L3Export reads from the cache
        cfg = KVCacheConfig(page_size=PAGE, window=16, num_full_pages=8, num_swa_pages=8)
        swa = [-1, 3, 6]

        @classmethod
        def page_tables(cls, _):
            return [5, 2, 7], cls.swa

    class Seq:
        req_id, num_computed = "s", 3 * PAGE + 1

        @staticmethod
        def block_hashes(_page, _seed):
            return [11, 12, 13, 14]

    export = L3Export(dev, Cache, "ns", KnownBlocks(8), lambda job: jobs.append(job) or True)
    export(Seq)  # a window page without SWA KV: the full values go, no checkpoint
    assert jobs[0].swa_keys == [] and len(jobs[0].items()) == 3
    Cache.swa = [4, 3, 6]
    export(Seq)  # the full values are known now: only the checkpoint
    assert jobs[1].full_keys == [] and jobs[1].swa_keys == ["ns:S:000000000000000d"]
    job, items = jobs[0], {**dict(jobs[0].items()), **dict(jobs[1].items())}
    assert all(memoryview(items[k]).nbytes == layout.full_bytes for k in job.full_keys)
    full = [items[k] for k in job.full_keys]
    staged = stage_values(host, layout, full[1:], items[jobs[1].swa_keys[0]], 3)  # blocks 1..2, window pages 0..2
    write_host_blocks(host, [0, 4], [1, 2, 3], staged)
    for t_dev, t_host, pairs in ((dev.full_k, host.full_k, ((2, 0), (7, 4))),
                                 (dev.full_v, host.full_v, ((2, 0), (7, 4))),
                                 (dev.swa_k, host.swa_k, ((4, 1), (3, 2), (6, 3))),
                                 (dev.swa_v, host.swa_v, ((4, 1), (3, 2), (6, 3)))):
        for d, h in pairs:
            assert torch.equal(t_dev[:, d], t_host[:, h])
    with pytest.raises(ValueError, match="layout sizes"):
        stage_values(host, layout, full[1:], items[jobs[1].swa_keys[0]], 4)


def _cache(host: int = 64) -> KVCache:
    return KVCache(KVCacheConfig(page_size=4, window=8, num_full_pages=64, num_swa_pages=32,
                                 num_host_full_pages=host, num_host_swa_pages=host // 2), audit_tokens=True)


def _serve(c: KVCache, sid: str, toks: list[int]) -> int:
    hit = c.match(toks)
    assert c.admit(sid, toks, hit, 2).ok
    assert c.reserve(sid, len(toks) - hit.tokens)
    c.commit(sid, len(toks) - hit.tokens, [7])
    c.finish(sid)
    c.check_invariants()
    return hit.tokens


def _at_baseline(c: KVCache) -> None:
    u = c.usage()
    for pool in (u.full, u.swa, u.host_full, u.host_swa):
        assert pool.in_use == 0 and pool.free + pool.cached == pool.capacity, pool
    c.check_invariants()


@pytest.mark.unit
def test_import_blocks_hangs_host_only_nodes_that_match_loads_and_counts_as_l3_once() -> None:
    c = _cache()
    t = tokens(1, 60)
    _serve(c, "a", t[:18])  # the tree holds pages 0..3 (full KV) of t
    assert c.cached_pages(t) == 4
    imp = c.import_blocks(t, None, 2, 12)  # fetched from page 2; the tree holds 0..3 by now: import 4..11
    assert imp is not None and (imp.start, imp.end, len(imp.full), len(imp.swa)) == (4, 12, 8, 2)
    assert c.usage().host_full.cached == 8 and c.usage().host_swa.cached == 2
    c.check_invariants()
    assert c.cached_pages(t) == 12
    hit = c.match(t)
    assert (hit.tokens, hit.host_tokens, hit.l3_tokens) == (48, 32, 32)
    assert len(hit.load_copies) == 8 + 2
    c.release_hit(hit)  # (released or not, the load moved them on device: the next hit is an L1 hit)
    c.check_invariants()
    again = c.match(t)
    assert (again.tokens, again.host_tokens, again.l3_tokens) == (48, 0, 0)
    c.release_hit(again)
    assert _serve(c, "b", t) == 48
    _at_baseline(c)


@pytest.mark.unit
def test_import_blocks_refuses_what_it_cannot_import_correctly() -> None:
    t = tokens(2, 60)
    assert KVCache(KVCacheConfig(page_size=4, window=8, num_full_pages=64, num_swa_pages=32)).import_blocks(
        t, None, 0, 4) is None  # no host tier
    c = _cache()
    _serve(c, "a", t[:18])
    assert c.import_blocks(t, None, 4, 5) is None  # the window [3, 5) reaches into local pages
    assert c.import_blocks(t, None, 5, 10) is None  # fetched from page 5, the tree holds only 4: a gap
    assert c.import_blocks(t, None, 0, 16) is None  # more pages than the prompt has
    assert c.usage().host_full.cached == 0
    _at_baseline(c)
    small = _cache(host=4)
    assert small.import_blocks(t, None, 0, 6) is None  # 6 host pages do not fit in 4
    assert small.import_blocks(t, None, 0, 4) is not None
    assert small.import_blocks(tokens(3, 60), None, 0, 4) is not None  # makes room: drops the LRU import
    assert small.cached_pages(t) == 0
    _at_baseline(small)


@pytest.mark.unit
@pytest.mark.parametrize("arena", [False, True])
def test_imports_mixed_with_serving_backups_and_eviction_keep_the_invariants(arena: bool) -> None:
    """Random serve / import / backup rounds on a small cache (device and host pressure): invariants after every
    operation, every import either refused or matched, pools back to baseline. On one arena (device and host),
    every backup copy carries the units its pages hold: a node backed up and then pruned in the same backup (a
    tombstone whose host-only child was dropped for room) once left copies from freed pages, which the engine
    ran as an out-of-range index."""
    import random

    rng = random.Random(5 if not arena else 137)
    c = _cache(host=12) if not arena else KVCache(KVCacheConfig(
        page_size=4, window=8, num_full_pages=0, num_swa_pages=0, arena_units=60, full_page_units=1,
        swa_page_units=3, host_arena_units=16), audit_tokens=True)
    stems = [tokens(100 + i, 40) for i in range(3)]
    imported = 0
    for i in range(300):
        t = [*rng.choice(stems)[:rng.randrange(8, 40)], *tokens(200 + i, rng.randrange(1, 12))]
        op = rng.random()
        if op < 0.4:
            hit = c.match(t)
            if c.admit(f"s{i}", t, hit, 2).ok and c.reserve(f"s{i}", len(t) - hit.tokens):
                c.commit(f"s{i}", len(t) - hit.tokens, [7])
                c.finish(f"s{i}")
            elif f"s{i}" in c.running():
                c.abort(f"s{i}")
        elif op < 0.85:
            e, end = c.cached_pages(t), rng.randrange(1, (len(t) - 1) // 4 + 1)
            imp = c.import_blocks(t, None, e, end)
            if imp is not None:
                imported += 1
                hit = c.match(t)
                assert hit.raw_tokens >= end * 4  # the walk finds the imported node
                # a valid hit at its end, loaded from L3, unless the device pools cannot take the loads now
                assert (hit.tokens >= end * 4 and hit.l3_tokens == (end - imp.start) * 4) or hit.l3_tokens == 0
                c.release_hit(hit)
        else:
            for cp in c.backup_to_host(rng.randrange(1, 8)):
                assert not arena or min(cp.units + cp.host_units) >= 0, cp
        c.check_invariants()
    assert imported >= 10
    _at_baseline(c)


# ------------------------------------------------------------------------------------------ engines
@pytest.fixture(scope="module")
def tiny():
    return (*load_model(None), load_tokenizer(None))


def make_core(tiny, **overrides) -> EngineCore:
    opts = dict(num_full_pages=256, num_swa_pages=96, max_num_seqs=8, num_host_full_pages=128,
                num_host_swa_pages=32)
    return engine_core(tiny, **{**opts, **overrides})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


class Served:
    """One engine with its GCache link, over `store`."""

    def __init__(self, tiny, store, **kw) -> None:
        self.core = make_core(tiny, **{k: v for k, v in kw.items() if k not in _LINK_ARGS})
        self.engine = AsyncEngine(self.core)
        ns = l3_namespace("", tiny[1], self.core.cache.cfg, "float32")
        # a generous lookup bound (a busy CI box must not turn the hits these tests expect into timeouts)
        link_args = {"lookup_timeout_s": 10.0, **{k: v for k, v in kw.items() if k in _LINK_ARGS}}
        self.link = GCacheLink(self.engine, store, ns, **link_args)
        self.link.attach()
        self.engine.start()

    async def generate(self, rid: str, prompt: list[int], n: int) -> tuple[list[int], int]:
        out: list[int] = []
        cached = -1
        async for o in self.engine.generate(Request(rid, prompt, greedy(n))):
            out += o.new_token_ids
            cached = o.num_cached_tokens
        return out, cached

    async def close(self) -> None:
        load = await self.engine.call(lambda core: (core.check_invariants(), core.load())[1], timeout_s=30)
        for pool in (load.usage.full, load.usage.swa, load.usage.host_full, load.usage.host_swa):
            assert pool.in_use == 0 and pool.free + pool.cached == pool.capacity, pool
        self.link.close()
        await asyncio.to_thread(self.engine.shutdown)
        self.core.close()


_LINK_ARGS = ("lookup_timeout_s", "write_queue", "write_queue_bytes", "writeback_every")


async def until(cond, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.02)


async def reference(tiny, prompt: list[int], n: int) -> list[int]:
    core = make_core(tiny, enable_prefix_cache=False, num_host_full_pages=0, num_host_swa_pages=0)
    async with AsyncEngine(core) as engine:
        out = [t async for o in engine.generate(Request("ref", prompt, greedy(n))) for t in o.new_token_ids]
    core.close()
    return out


@pytest.mark.integration
@pytest.mark.parametrize("arena", [False, True], ids=["static", "arena"])
async def test_prefix_from_l3_equals_a_cache_disabled_run(tiny, arena):
    """Also with the device KV on one arena (kv_arena): the write-back gathers by unit, the lookup stages values
    by the group shapes (an arena engine's per-group tensors hold no pages: the lookup used to index them)."""
    store = MemoryBlockStore()
    first = tokens(10, 70)
    a = Served(tiny, store, kv_arena=arena)
    out1, _ = await a.generate("t1", first, 12)  # 70 + 12 tokens: 81 computed, 20 pages written back
    await until(lambda: a.link.counts()["writebacks"] == 1)
    await a.close()
    assert len(store.values) == 20 + 1  # 20 full values, one checkpoint (at block 19), no SWA for every token
    turn2 = [*first, *out1, *tokens(11, 9)]
    b = Served(tiny, store, kv_arena=arena)  # its own cache is empty
    out2, cached = await b.generate("t2", turn2, 10)
    assert cached == 80  # the first turn's prompt + output, page aligned: all of it from L3
    assert out2 == await reference(tiny, turn2, 10)
    counts = b.link.counts()
    assert (counts["lookups"], counts["hits"], counts["imported_tokens"]) == (1, 1, 80)
    load = await b.engine.call(lambda core: core.load())
    assert (load.hit_tokens, load.l3_hit_tokens, load.host_hit_tokens) == (80, 80, 0)
    await until(lambda: b.link.counts()["writebacks"] == 1)
    assert b.link.counts()["written_values"] == 6  # only the new blocks 20..24 and their checkpoint
    await b.close()


@pytest.mark.integration
async def test_a_running_sequence_written_back_every_n_tokens_resumes_from_l3(tiny):
    """#36: with `writeback_every` a generating sequence writes its new pages and a checkpoint to L3 each time it
    crosses a multiple of 32 tokens. Engine A stops mid-answer (its stream left, as when its worker dies: no
    finish write-back); engine B, its caches empty, continues the request from the prompt and the tokens already
    sent: it loads the written prefix from L3 instead of recomputing it and gives the rest of a cache-disabled
    run's answer."""
    store = MemoryBlockStore()
    prompt = tokens(30, 40)
    a = Served(tiny, store, writeback_every=32)
    sent: list[int] = []
    async with contextlib.aclosing(a.engine.generate(Request("m1", prompt, greedy(80)))) as outputs:
        async for o in outputs:
            sent += o.new_token_ids
            if len(sent) >= 50:
                break  # 40 + 50 tokens: the sequence crossed 64 (output 24), not 96 yet
    await until(lambda: a.link.counts()["writebacks"] >= 1)  # at 64 (and at 96 if the engine ran that far ahead)
    await a.close()
    b = Served(tiny, store)
    rest: list[int] = []
    cached = -1
    async for o in b.engine.generate(Request("m1-r1", prompt, greedy(80), resumed=sent[:50])):
        rest += o.new_token_ids
        cached = o.num_cached_tokens
    # the prefix it starts from (90 tokens) reaches the checkpoint at page 16, not the one at 24 (if written)
    assert cached == 64 and b.link.counts()["imported_tokens"] == 64
    assert sent[:50] + rest == await reference(tiny, prompt, 80)
    await b.close()


@pytest.mark.unit
def test_l3_checkpoints_are_the_end_and_every_k_pages_whose_window_the_cache_kept() -> None:
    assert l3_checkpoint_ends(20, 0) == [20] and l3_checkpoint_ends(0, 8) == []
    assert l3_checkpoint_ends(20, 8) == [8, 16, 20] and l3_checkpoint_ends(16, 8) == [8, 16]
    table = [-1] * 4 + [1, 2, 3, 4] + [-1] * 8 + [5, 6, 7, 8]  # windows kept at 8 and at the end (20)
    assert l3_checkpoints(table, 20, 4, 8) == [8, 20]
    assert l3_checkpoints(table, 20, 4, 0) == [20]
    table[5] = -1  # the cache took the periodic window back: not written
    assert l3_checkpoints(table, 20, 4, 8) == [20]


@pytest.mark.unit
def test_the_service_turns_gcache_checkpoint_every_into_the_caches_periodic_checkpoints() -> None:
    from libs.worker.config import EngineServiceConfig

    assert EngineServiceConfig(page_size=16, gcache=True).engine_config().checkpoint_every_pages == 512 // 16
    assert EngineServiceConfig(page_size=16, gcache=True, gcache_checkpoint_every=0).engine_config(
    ).checkpoint_every_pages == 0
    assert EngineServiceConfig(page_size=48).engine_config().checkpoint_every_pages == 0  # no GCache: unchanged
    with pytest.raises(ValueError, match="multiple of page_size"):
        EngineServiceConfig(page_size=48, gcache=True)


@pytest.mark.integration
async def test_a_prompt_sharing_only_a_mid_prompt_prefix_hits_a_periodic_l3_checkpoint(tiny):
    """With checkpoint_every_pages the write-back also stores the checkpoints the cache kept every 8 pages: a
    later prompt that shares only the first 40 tokens of an earlier one (not its end) gets 32 of them from L3
    (L1 and L2 empty) and the outputs of a cache-disabled run. Without periodic checkpoints it would miss."""
    store = MemoryBlockStore()
    first = tokens(80, 70)
    a = Served(tiny, store, checkpoint_every_pages=8)
    await a.generate("p1", first, 12)  # 81 computed: 20 pages, checkpoints at 8, 16 and 20
    await until(lambda: a.link.counts()["writebacks"] == 1)
    await a.close()
    assert len(store.values) == 20 + 3
    second = [*first[:40], *tokens(81, 30)]  # shares pages 0..9 (40 tokens): the stored checkpoint at page 8
    b = Served(tiny, store, checkpoint_every_pages=8)
    out, cached = await b.generate("p2", second, 8)
    assert cached == 8 * PAGE
    assert b.link.counts()["hits"] == 1 and b.link.counts()["imported_tokens"] == 8 * PAGE
    assert out == await reference(tiny, second, 8)
    await b.close()


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.parametrize("heads", ["tiny", "even"])
async def test_parallel_engines_write_every_kv_head_and_import_them(tiny, heads):
    """#18: a tp=2 + ep=2 engine writes back the same L3 values (every KV head, gathered from its ranks) as one
    process, and a tp=2 engine imports them into each rank's host tier (its heads only): its second turn is
    cached from L3 and equals a cache-disabled run; pools back to baseline on both. Every rank holds one device
    and one host arena, addressed by rank 0's units: "tiny" (1 full / 2 SWA KV heads: at tp = 2 the full head is
    replicated, the SWA heads split, so the SWA plane slots are padded) and "even" (2 / 4, split alike)."""
    if heads == "even":
        from tests.test_parallel import even_heads_model

        tiny = (*even_heads_model(), tiny[2])
    first = tokens(10, 70)
    plain, sharded = MemoryBlockStore(), MemoryBlockStore()
    outs = []
    for store, layout in ((plain, {}), (sharded, {"tp": 2, "ep": 2})):
        a = Served(tiny, store, **layout)
        outs.append((await a.generate("t1", first, 12))[0])
        await until(lambda a=a: a.link.counts()["writebacks"] == 1)
        await a.close()
    assert outs[0] == outs[1] and plain.values.keys() == sharded.values.keys() and len(plain.values) == 21
    for key, value in plain.values.items():  # the same bytes' worth of KV, within fp32 summation order
        torch.testing.assert_close(torch.frombuffer(bytearray(sharded.values[key]), dtype=torch.float32),
                                   torch.frombuffer(bytearray(value), dtype=torch.float32), rtol=1e-4, atol=1e-4)
    turn2 = [*first, *outs[0], *tokens(11, 9)]
    b = Served(tiny, sharded, tp=2)
    assert b.core.runner.kv.arena is not None and b.core.runner.host is not None
    out2, cached = await b.generate("t2", turn2, 10)
    assert cached == 80 and b.link.counts()["hits"] == 1
    assert out2 == await reference(tiny, turn2, 10)
    await b.close()


@pytest.mark.integration
async def test_full_pages_from_l1_and_l3_with_the_checkpoint_from_l3(tiny):
    store = MemoryBlockStore()
    first = tokens(20, 70)
    a = Served(tiny, store)
    out1, _ = await a.generate("t1", first, 12)
    await until(lambda: a.link.counts()["writebacks"] == 1)
    await a.close()
    turn2 = [*first, *out1, *tokens(21, 9)]
    b = Served(tiny, store)
    await b.generate("short", first[:22], 2)  # B's tree: pages 0..4 of the prompt (full KV, device)
    imported_before = b.link.counts()["imported_tokens"]
    out2, cached = await b.generate("t2", turn2, 10)
    assert cached == 80
    assert b.link.counts()["imported_tokens"] - imported_before == (20 - 5) * PAGE  # pages 5..19 from L3
    assert out2 == await reference(tiny, turn2, 10)
    load = await b.engine.call(lambda core: core.load())
    assert load.l3_hit_tokens == 60 and load.hit_tokens - load.l3_hit_tokens - load.host_hit_tokens == 20
    await b.close()


class HangingStore(MemoryBlockStore):
    """Every lookup call waits forever (a node that accepted the connection and never answers)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        self.calls += 1
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


@pytest.mark.integration
async def test_a_hanging_store_is_a_miss_after_the_lookup_bound(tiny):
    store = HangingStore()
    prompt = tokens(30, 40)
    s = Served(tiny, store, lookup_timeout_s=0.3)
    out, cached = await s.generate("q", prompt, 8)
    assert store.calls == 1 and s.link.counts()["timeouts"] == 1 and cached == 0
    assert out == await reference(tiny, prompt, 8)
    await s.close()


class StuckWriter(MemoryBlockStore):
    """put_nowait blocks the writer thread until released (a client whose IO thread is wedged)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def put_nowait(self, items: Sequence[tuple[str, Buffer]]) -> bool:
        self.entered.set()
        self.release.wait(60)
        return super().put_nowait(items)


@pytest.mark.integration
async def test_a_full_write_back_queue_drops_and_never_stalls_decoding(tiny):
    store = StuckWriter()
    s = Served(tiny, store, write_queue=1)
    try:
        out, _ = await s.generate("w0", tokens(40, 24), 4)  # its batch wedges the writer thread
        await asyncio.to_thread(store.entered.wait, 10)
        for i in range(1, 4):  # the 2nd batch fills the queue, the 3rd and 4th are dropped
            await s.generate(f"w{i}", tokens(40 + i, 24), 4)
        assert s.link.counts()["dropped"] == 2
        prompt = tokens(50, 30)
        assert (await s.generate("after", prompt, 6))[0] == await reference(tiny, prompt, 6)
    finally:
        store.release.set()
    await until(lambda: s.link.counts()["writebacks"] == 2)
    await s.close()


# ------------------------------------------------------------------------------------------ services
def _gcache_service(cls, config_cls, nats_url: str, ns: str, store):
    from tests.test_worker import service_config

    svc = cls(service_config(config_cls, nats_url, namespace=ns, gcache=True, gcache_host_full_pages=128,
                             gcache_host_swa_pages=32, gcache_lookup_timeout_s=10.0))
    svc.gcache_store = store
    return svc


@pytest.mark.integration
async def test_two_workers_share_gcache_second_turn_elsewhere_is_cached(bus, nats_url):
    from services.worker.config import WorkerConfig
    from services.worker.service import WorkerService
    from tests.test_kv_events import serve

    ns = f"g_{uuid.uuid4().hex[:8]}"
    store = MemoryBlockStore()
    svcs = [_gcache_service(WorkerService, WorkerConfig, nats_url, ns, store) for _ in range(2)]
    for svc in svcs:
        await svc.start()
    try:
        first = tokens(60, 50)
        _, out = await serve(bus, svcs[0], "turn1", first, 6)
        await until(lambda: svcs[0].gcache.counts()["writebacks"] == 1)
        final, _ = await serve(bus, svcs[1], "turn2", [*first, *out, *tokens(61, 7)], 6)
        assert final.usage.cached_tokens == (50 + 6 - 1) // PAGE * PAGE  # turn 1's prompt + output, page aligned
        details = svcs[1].health_details()
        assert details["gcache_hits"] == "1" and details["gcache_imported_tokens"] == str(final.usage.cached_tokens)
    finally:
        for svc in svcs:
            await svc.stop()


@pytest.mark.integration
async def test_disaggregated_second_turn_on_the_other_prefill_worker_is_cached(bus, nats_url, monkeypatch):
    """2 prefill + 1 decode over one store: prefill writes the prompt back at hand-off, decode prompt + output."""
    from services.decode.config import DecodeConfig
    from services.decode.service import DecodeService
    from services.prefill.config import PrefillConfig
    from services.prefill.service import PrefillService
    from tests.test_kv_events import serve

    monkeypatch.setenv("WINDSERVE_TRANSFER", "tcp")
    ns = f"gd_{uuid.uuid4().hex[:8]}"
    store = MemoryBlockStore()
    decode = _gcache_service(DecodeService, DecodeConfig, nats_url, ns, store)
    prefills = [_gcache_service(PrefillService, PrefillConfig, nats_url, ns, store) for _ in range(2)]
    for svc in (decode, *prefills):
        await svc.start()
    try:
        did = decode.config.instance_id
        first = tokens(70, 45)
        _, out = await serve(bus, prefills[0], "turn1", first, 8, decode=did)
        await until(lambda: decode.gcache.counts()["writebacks"] == 1
                    and prefills[0].gcache.counts()["writebacks"] == 1)
        turn2 = [*first, *out, *tokens(71, 6)]
        final, out2 = await serve(bus, prefills[1], "turn2", turn2, 8, decode=did)
        assert final.usage.cached_tokens >= (45 + 8 - 1) // PAGE * PAGE
        assert prefills[1].gcache.counts()["hits"] == 1
        tiny_ref = (decode.engine.core.runner.model, decode.engine.core.model_config, None)
        assert out2 == await reference(tiny_ref, turn2, 8)
    finally:
        for svc in (*prefills, decode):
            await svc.stop()


def test_the_sdk_chunk_and_message_sizes_come_from_the_worker_config(monkeypatch) -> None:
    from libs.service.config import load_config
    from services.worker.config import WorkerConfig

    monkeypatch.delenv("WINDSERVE_GCACHE_CHUNK_MIB", raising=False)
    monkeypatch.delenv("WINDSERVE_GCACHE_MESSAGE_MIB", raising=False)
    cfg = load_config(WorkerConfig).gcache_config()
    assert (cfg.chunk_bytes, cfg.message_bytes) == (4 << 20, 64 << 20)  # the SDK's defaults
    monkeypatch.setenv("WINDSERVE_GCACHE_CHUNK_MIB", "16")
    monkeypatch.setenv("WINDSERVE_GCACHE_MESSAGE_MIB", "8")
    cfg = load_config(WorkerConfig).gcache_config()
    assert (cfg.chunk_bytes, cfg.message_bytes) == (16 << 20, 8 << 20)
