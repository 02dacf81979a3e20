"""The engine on one KV arena (issue #13, EngineConfig.kv_arena): one K and one V buffer of units for both
layer groups, the same outputs as the two static pools, more concurrent sequences where a static split of the
same bytes runs out of SWA pages; MTP draft layers and the disaggregated hand-off on the arena."""

from __future__ import annotations

import pytest
import torch

from libs.engine import LLM, EngineConfig, EngineCore, Request, SamplingParams
from libs.engine.gcache_tier import kv_layout
from libs.kvcache import plan_arena
from tests.test_disagg import OPTS as DISAGG_OPTS
from tests.test_disagg import Pipeline, tokens_of, ucx_config
from tests.test_engine import PAGE, assert_baseline, greedy, make_core, run_round, tokens
from tests.test_engine import tiny as tiny  # the module-scoped tiny model fixture

pytestmark = pytest.mark.integration


def _run_counting(core: EngineCore, prompts: dict[str, list[int]], n_out: int) -> tuple[dict[str, list[int]], int]:
    """Greedy outputs and the most sequences running at once."""
    for rid, p in prompts.items():
        core.add_request(Request(rid, p, greedy(n_out)))
    got: dict[str, list[int]] = {}
    peak = 0
    for _ in range(5000):
        if not core.has_work():
            return got, peak
        for out in core.step():
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
        peak = max(peak, len(core.scheduler.running))
        core.check_invariants()
    raise AssertionError("engine did not drain")


def test_one_buffer_of_units_admits_more_short_sequences_than_the_static_split(tiny):
    """64 full + 10 SWA pages (page 4); 12 short sequences of 3 pages (shorter than the window: 3 full + 3 SWA
    pages each), so the static split runs 3 at once (10 SWA pages) with most full pages idle. The arena of the
    same bytes is ONE K and one V buffer of units x unit bytes (104 units; a sequence takes 3 + 3 x 4) and
    runs 6 at once, with the same greedy outputs."""
    _, cfg, _ = tiny
    opts = dict(num_full_pages=64, num_swa_pages=10, max_num_batched_tokens=64, enable_prefix_cache=False)
    static, arena = make_core(tiny, kv_arena=False, **opts), make_core(tiny, kv_arena=True, **opts)
    layout = kv_layout(cfg, arena.config.torch_dtype)
    budget = 64 * layout.full_page_bytes(4) + 10 * layout.swa_page_bytes(4)
    plan = plan_arena(budget, layout, 4)
    assert arena.runner.kv.pool_bytes() == {"arena": plan.units * plan.unit_bytes}
    assert plan.units * plan.unit_bytes == budget == sum(static.runner.kv.pool_bytes().values())
    assert arena.runner.kv.full_k.shape[1] == arena.runner.kv.swa_k.shape[1] == 0  # no per-group pool
    prompts = {f"s{i}": tokens(300 + i, 6) for i in range(12)}
    got_static, peak_static = _run_counting(static, prompts, 4)
    got_arena, peak_arena = _run_counting(arena, prompts, 4)
    assert got_arena == got_static
    assert peak_static <= 3 and peak_arena >= 6, (peak_static, peak_arena)
    assert_baseline(arena)
    a = arena.usage().arena
    assert a is not None and a.free == a.units


def test_mtp_draft_layers_on_the_arena_equal_mtp_off(tiny):
    """Speculative decoding with 2 MTP blocks (their KV: extra SWA layers of the arena's SWA pages) under
    memory pressure with prefix hits equals MTP off on static pools."""
    opts = dict(num_full_pages=64, num_swa_pages=28, max_num_batched_tokens=40, admission_decode_tokens=2)
    off, on = make_core(tiny, kv_arena=False, **opts), make_core(tiny, speculative_tokens=2, kv_arena=True, **opts)
    stem = tokens(400, 30)
    for turn in range(2):
        prompts = {f"m{i}t{turn}": stem + tokens(410 + i + 10 * turn, 5 + i) for i in range(4)}
        assert run_round(on, prompts, 12) == run_round(off, prompts, 12), f"turn {turn}"
    assert on.scheduler.stats.hit_tokens > 0
    spec = on.spec_stats()
    assert spec is not None and spec.drafted_tokens > 0
    assert_baseline(on)


async def test_disaggregated_hand_off_between_arena_engines_equals_colocated(tiny):
    """Prefill and decode engines both on the arena: the shipment gathers each layer's pages through the
    unit tables and lands them in the decode arena's units in place; tokens equal a colocated static engine."""
    model, cfg, _ = tiny
    prompts = [tokens(500 + i, n) for i, n in enumerate((5, 37, 70))]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    expected = [list(o.token_ids) for o in LLM.from_core(
        EngineCore(EngineConfig(**{**DISAGG_OPTS, "kv_arena": False}), model, cfg, None)).generate(prompts, params)]
    async with Pipeline(tiny, ucx_config(), kv_arena=True) as pipe:
        assert pipe.decode_engine.core.runner.kv.arena is not None
        results = [await pipe.generate(f"a{i}", p, 10) for i, p in enumerate(prompts)]
        await pipe.assert_no_kv_in_use()
    assert [tokens_of(r) for r in results] == expected


def test_request_bounds_read_the_arena(tiny):
    """The bounds the services refuse beyond (400) are the arena's on the arena. 16 full + 8 SWA pages of 4
    tokens as one arena: 16 + 8 x 4 = 48 units (a full page 1 unit, an SWA page 4); a sequence holds its
    window's 5 SWA pages (20 units) and up to 28 full pages: 112 tokens (static: the 16 full pages, 64). A
    request of exactly 112 tokens runs to its end with the outputs of a fresh recompute; one more is refused.
    A decode worker reserves an arriving prompt whole (a full and an SWA page per prompt page, 5 units) and a
    full page for the first token: 36 tokens (9 pages: 10 + 36 units) land, 37 (10 pages: 50 units) never do
    (static: 8 SWA pages, 32 tokens)."""
    from libs.engine.disagg import DecodeFull, DisaggEngineCore, RemoteRequest
    from libs.engine.runner import direct_greedy

    model, cfg, tok = tiny
    opts = dict(num_full_pages=16, num_swa_pages=8)
    core = make_core(tiny, **opts)
    assert core.cache.cfg.arena_units == 48 and core.max_seq_pages == 28
    assert (core.max_request_tokens, make_core(tiny, kv_arena=False, **opts).max_request_tokens) == (112, 64)
    with pytest.raises(ValueError, match="needs 29 KV pages"):
        core.add_request(Request("over", tokens(600, 101), greedy(12)))
    prompt = tokens(601, 100)
    got = run_round(core, {"edge": prompt}, 12)
    assert got["edge"] == direct_greedy(model, cfg, prompt, 12, page_size=4)
    assert_baseline(core)

    decode = DisaggEngineCore(EngineConfig(page_size=4, bucket_edges=(), **opts), model, cfg, tok)
    static = DisaggEngineCore(EngineConfig(page_size=4, bucket_edges=(), kv_arena=False, **opts), model, cfg, tok)
    assert (decode.max_remote_prompt_tokens, static.max_remote_prompt_tokens) == (36, 32)
    decode.add_request(RemoteRequest("fits", tokens(602, 36), greedy(1)))
    a = decode.cache.usage().arena
    assert a is not None and (a.full_in_use, a.swa_in_use, a.reserved, a.free) == (9, 36, 1, 3)  # 2 units spare
    decode.abort("fits")
    with pytest.raises(DecodeFull, match="no KV room"):
        decode.add_request(RemoteRequest("never", tokens(603, 37), greedy(1)))
    assert_baseline(decode)


def test_a_rank_arena_keeps_the_models_layout_over_its_own_heads():
    """A parallel rank's arena (`sub`: the whole model's layer-pages per plane slot) over its own KV heads. The
    tiny model (1 full / 2 SWA KV heads) at tp = 2: a rank holds the full head (replicated) and one SWA head, so
    its plane slot is 2 heads, a full layer-page fills it and an SWA layer-page uses 1 of its 2 rows (stride
    2). Every layer-page of pages on disjoint units, written through its rows, reads back intact (a wrong
    stride makes two pages share a row); an unpadded arena is unchanged (stride = r_g)."""
    from array import array

    from libs.engine.parallel.layout import ParallelLayout
    from libs.model.config import ModelConfig
    from libs.model.paged import KVPools, arena_sub

    cfg = ModelConfig.tiny()
    assert KVPools.allocate_arena(cfg, 4, 1, 4).arena.stride == arena_sub(cfg) == {"full": 2, "swa": 1}
    local = ParallelLayout(tp=2).local_config(cfg)
    pools = KVPools.allocate_arena(local, 48, 2, 4, sub=arena_sub(cfg))
    a = pools.arena
    assert a is not None and a.sub == {"full": 2, "swa": 1} and a.stride == {"full": 2, "swa": 2}
    assert a.k.shape[3] == 2
    per = {g: a.units_per_page(g) for g in ("full", "swa")}
    pages = {"full": 5, "swa": 6}
    tables, nxt = {}, 0
    for g in ("full", "swa"):  # each page its own units, as the cache hands them out
        tables[g] = array("q", range(nxt, nxt + pages[g] * per[g]))
        nxt += pages[g] * per[g]
    assert nxt <= a.units
    a.bind({g: (t, per[g]) for g, t in tables.items()})
    stamp = 0
    want = {}
    for g in ("full", "swa"):
        for layer in range(pools.num_layers(g)):
            k, v, _ = pools.layer_kv(g, layer)
            for p in range(pages[g]):
                stamp += 1
                row = pools.page_rows(g, layer, torch.tensor([p]))
                k[row] = float(stamp)
                v[row] = float(-stamp)
                want[g, layer, p] = stamp
    for (g, layer, p), st in want.items():
        k, v, _ = pools.layer_kv(g, layer)
        row = pools.page_rows(g, layer, torch.tensor([p]))
        assert bool((k[row] == st).all()) and bool((v[row] == -st).all()), (g, layer, p)
        gk, gv = pools.gather_pages(g, [p])  # the flat rows (L2 / L3 copies) agree with the layer rows
        assert float(gk[0, layer].flatten()[0]) == st and float(gv[0, layer].flatten()[0]) == -st


def test_parallel_engines_use_the_arena_with_any_layout():
    """The arena is the default with tp / ep > 1 too, also where a rank's two groups hold unequal shares of the
    KV heads (the tiny model at tp = 2); kv_arena=False asks for the static pools everywhere."""
    from libs.engine.core import arena_plan
    from libs.model.config import ModelConfig

    cfg = ModelConfig.tiny()
    for config in (EngineConfig(), EngineConfig(ep=2), EngineConfig(tp=2), EngineConfig(tp=2, ep=2)):
        assert arena_plan(config, cfg) is not None
    assert arena_plan(EngineConfig(kv_arena=False, tp=2), cfg) is None


@pytest.mark.parametrize(("load_mode", "host_pages"), [("sync", (256, 128)), ("thread", (256, 128)),
                                                      ("sync", (24, 12)), ("thread", (24, 12))])
def test_host_arena_under_memory_pressure_matches_cache_disabled(tiny, load_mode, host_pages):
    """The host tier (L2) on one host arena beside the device arena: L2 backups and load-backs copy between
    the two unit-addressed buffers (both sides translated through the cache's unit tables) and the outputs
    equal a cache-disabled engine. (24, 12): a host arena of those pages' bytes, so small that host copies are
    evicted (by value per unit) while loads of others are planned; the host books stay exact."""
    from libs.engine.core import host_plan
    from libs.kvcache import EventKind, Tier
    from tests.test_engine import conversations

    _, cfg, _ = tiny
    nf, ns = host_pages
    opts = dict(num_full_pages=72, num_swa_pages=36, max_num_batched_tokens=40, l2_backup_watermark=0.3,
                l2_backup_pages=16, admission_decode_tokens=2, l2_load_mode=load_mode)
    pressured = make_core(tiny, num_host_full_pages=nf, num_host_swa_pages=ns, **opts)
    layout = kv_layout(cfg, pressured.config.torch_dtype)
    budget = nf * layout.full_page_bytes(PAGE) + ns * layout.swa_page_bytes(PAGE)
    # the same host tier sized by its byte budget alone (no ratio): the same arena
    by_bytes = EngineConfig(**{**pressured.config.__dict__, "num_host_full_pages": 0, "num_host_swa_pages": 0,
                               "host_kv_bytes": budget})
    plan = host_plan(pressured.config, cfg, pressured.cache.arena and plan_arena(
        72 * layout.full_page_bytes(PAGE) + 36 * layout.swa_page_bytes(PAGE), layout, PAGE))
    assert plan.arena is not None and plan == host_plan(by_bytes, cfg, plan_arena(
        72 * layout.full_page_bytes(PAGE) + 36 * layout.swa_page_bytes(PAGE), layout, PAGE))
    host = pressured.runner.host
    assert host is not None and host.arena is not None and pressured.cache.cfg.host_arena_units == plan.arena.units
    assert host.pool_bytes() == {"arena": plan.arena.units * plan.arena.unit_bytes} and (
        plan.arena.units * plan.arena.unit_bytes == budget)
    reference = make_core(tiny, enable_prefix_cache=False)
    systems, users = conversations()
    history = {c: list(systems[c % 2]) for c in range(6)}
    events = []
    for turn in range(3):
        prompts = {f"c{c}t{turn}": history[c] + users[(c, turn)] for c in range(6)}
        got = run_round(pressured, prompts, n_out=22)
        assert got == run_round(reference, prompts, n_out=22), f"turn {turn}"
        events += pressured.drain_kv_events()
        for c in range(6):
            history[c] = prompts[f"c{c}t{turn}"] + got[f"c{c}t{turn}"]
    stats = pressured.scheduler.stats
    assert stats.backed_up_pages > 0 and stats.loaded_pages > 0 and stats.host_hit_tokens > 0
    host_removed = any(e.kind is EventKind.REMOVED and e.tier is Tier.HOST for e in events)
    assert host_removed == (nf < 100), "a small host arena evicts host copies, a large one does not"
    pressured.check_invariants()  # units free + cached == host arena, the unit map exact
    assert_baseline(pressured)
    h = pressured.usage().host_arena
    assert h is not None and h.units == plan.arena.units and h.free + h.full_cached + h.swa_cached == h.units


def test_worker_metrics_export_the_arenas_by_tier_and_state(tiny):
    """The Prometheus gauges carry both arenas (device, host) unit for unit, their states summing to the arena."""
    from prometheus_client import REGISTRY

    from libs.worker.metrics import export

    core = make_core(tiny, num_host_full_pages=64, num_host_swa_pages=32, l2_backup_watermark=0.9,
                     l2_backup_pages=16)
    run_round(core, {"a": tokens(3, 40), "b": tokens(4, 70)}, n_out=8)
    load = core.load()
    export(load, {})
    get = REGISTRY.get_sample_value
    for tier, arena in (("device", load.usage.arena), ("host", load.usage.host_arena)):
        assert arena is not None, tier
        seen = {st: get("windserve_worker_kv_arena_units", {"tier": tier, "state": st}) for st in
                ("units", "free", "full_in_use", "full_cached", "swa_in_use", "swa_cached")}
        assert seen["units"] == arena.units > 0 and seen["full_cached"] == arena.full_cached
        assert seen["free"] + seen["full_in_use"] + seen["full_cached"] + seen["swa_in_use"] + seen["swa_cached"] \
            == seen["units"]
    assert load.usage.arena is not None and load.usage.arena.full_cached > 0  # the prompts stayed cached


def test_live_loads_are_the_loads_plan_copies_runs():
    """A parallel engine's other ranks hold no unit tables: rank 0 sends them `live_loads`, which must be exactly
    the h2d copies `plan_copies` runs on rank 0 (the last per target page, whose page still holds its units)."""
    from array import array

    from libs.engine.host_tier import live_loads, plan_copies
    from libs.kvcache.types import PageCopy
    from libs.model.config import ModelConfig
    from libs.model.paged import KVPools

    pools = KVPools.allocate_arena(ModelConfig.tiny(), 64, 1, 4)
    a = pools.arena
    assert a is not None
    per = {g: a.units_per_page(g) for g in ("full", "swa")}
    tables = {g: array("q", [-1] * (8 * per[g])) for g in per}
    for g in per:  # page p of group g holds units 10 * p + j (+ 1 for SWA)
        for p in range(8):
            for j in range(per[g]):
                tables[g][p * per[g] + j] = 10 * p + j + (g == "swa")
    a.bind({g: (t, per[g]) for g, t in tables.items()})

    def units(g: str, p: int, stale: bool = False) -> tuple[int, ...]:
        return tuple(10 * p + j + (g == "swa") + (100 if stale else 0) for j in range(per[g]))

    copies = [PageCopy("full", 0, 1, "h2d", units("full", 1)),
              PageCopy("full", 1, 2, "h2d", units("full", 2, stale=True)),  # evicted since: dropped
              PageCopy("swa", 2, 3, "h2d", units("swa", 3)),  # overwritten by the next copy to page 3
              PageCopy("swa", 4, 3, "h2d", units("swa", 3)),
              PageCopy("full", 5, 4, "h2d", units("full", 4)),  # live, then a stale one to page 4 wins: dropped
              PageCopy("full", 6, 4, "h2d", units("full", 4, stale=True))]
    live = live_loads(copies, pools)
    assert live == [copies[0], copies[3]]
    ran = {g: (src, dst) for g, (src, dst, _, _) in plan_copies(copies, "h2d", pools).items()}
    assert ran == {g: (src, dst) for g, (src, dst, _, _) in plan_copies(live, "h2d", pools).items()}
    assert ran == {"full": ([0], [1]), "swa": ([4], [3])}
