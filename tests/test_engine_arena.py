"""The engine on one KV arena (issue #13, EngineConfig.kv_arena): one K and one V buffer of units for both
layer groups, the same outputs as the two static pools, more concurrent sequences where a static split of the
same bytes runs out of SWA pages; MTP draft layers and the disaggregated hand-off on the arena."""

from __future__ import annotations

import pytest

from libs.engine import LLM, EngineConfig, EngineCore, Request, SamplingParams
from libs.engine.l3 import kv_layout
from libs.kvcache import plan_arena
from tests.test_disagg import OPTS as DISAGG_OPTS
from tests.test_disagg import Pipeline, tokens_of, ucx_config
from tests.test_engine import assert_baseline, greedy, make_core, run_round, tokens
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
    static, arena = make_core(tiny, **opts), make_core(tiny, kv_arena=True, **opts)
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
    off, on = make_core(tiny, **opts), make_core(tiny, speculative_tokens=2, kv_arena=True, **opts)
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
        EngineCore(EngineConfig(**DISAGG_OPTS), model, cfg, None)).generate(prompts, params)]
    async with Pipeline(tiny, ucx_config(), kv_arena=True) as pipe:
        assert pipe.decode_engine.core.runner.kv.arena is not None
        results = [await pipe.generate(f"a{i}", p, 10) for i, p in enumerate(prompts)]
        await pipe.assert_no_kv_in_use()
    assert [tokens_of(r) for r in results] == expected
