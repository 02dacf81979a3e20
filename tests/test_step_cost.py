"""Step cost model (pure) and the scheduler's time-based long-prefill cap."""

import pytest

from libs.engine.request import Request, SamplingParams
from libs.engine.scheduler import COLD_LONG_CHUNK, LONG_STARVE_STEPS, SampledToken, Scheduler, SchedulerConfig
from libs.engine.step_cost import MIN_SAMPLES, CostFit, StepCostModel, _fit, fit_step_cost
from libs.kvcache import KVCache, KVCacheConfig

pytestmark = pytest.mark.unit

TRUE = CostFit(fixed=4e-3, per_token=1.5e-4, per_pair=2e-7)


def synthetic(n: int = 60, true: CostFit = TRUE) -> list[tuple[int, int, float, int]]:
    out = []
    for i in range(n):
        tokens = 1 + (i * 37) % 200
        pairs = tokens * (tokens + (i * 101) % 3000)
        seqs = (i * 13) % 4
        wobble = 1.0 + 0.02 * ((i * 7) % 5 - 2) / 2  # deterministic +-2% "noise"
        out.append((tokens, pairs, true.predict(tokens, pairs, seqs) * wobble, seqs))
    return out


@pytest.mark.parametrize("true", [TRUE, CostFit(fixed=4e-3, per_token=1.5e-4, per_pair=2e-7, per_seq=1.2e-3)])
def test_fit_recovers_known_coefficients(true):
    fit = fit_step_cost(synthetic(true=true))
    assert fit is not None
    assert fit.fixed == pytest.approx(true.fixed, rel=0.1)
    assert fit.per_token == pytest.approx(true.per_token, rel=0.1)
    assert fit.per_pair == pytest.approx(true.per_pair, rel=0.1)
    assert fit.per_seq == pytest.approx(true.per_seq, rel=0.1, abs=1e-4)


def test_per_sequence_cost_is_not_fitted_when_every_step_has_the_same_count():
    """Always one prefill chunk per step: the per-sequence term cannot be told from the fixed cost."""
    samples = [(t, p, s, 1) for t, p, s, _ in synthetic(true=CostFit(fixed=5e-3, per_token=1.5e-4, per_pair=2e-7))]
    fit = fit_step_cost(samples)
    assert fit is not None and fit.per_seq == 0.0 and fit.fixed == pytest.approx(5e-3, rel=0.1)


def test_fit_needs_more_than_one_token_count():
    assert fit_step_cost([(32, 32 * 40, 0.005, 1)] * 20) is None


def test_model_fits_only_after_enough_samples():
    m = StepCostModel()
    samples = synthetic(MIN_SAMPLES)
    for s in samples[:-1]:
        m.observe(*s)
    assert m.fit is None
    m.observe(*samples[-1])
    assert m.fit is not None


def test_sliding_window_sums_match_a_fit_over_the_window():
    """The running sums (evicted samples subtracted, rebuilt every window) give the fit of the window's samples."""
    true = CostFit(fixed=4e-3, per_token=1.5e-4, per_pair=2e-7, per_seq=1.2e-3)
    m = StepCostModel(window=64)
    for i, (t, p, sec, q) in enumerate(synthetic(500, true=true)):
        m.observe(t, p, sec, q)
        if i % 97 == 0 and i >= 64:
            got, want = _fit(m._sums), fit_step_cost(list(m._samples))
            assert got is not None and want is not None
            assert [got.fixed, got.per_token, got.per_pair, got.per_seq] == pytest.approx(
                [want.fixed, want.per_token, want.per_pair, want.per_seq], rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("budget,prefix", [(0.0, 0), (1e-3, 100), (5e-3, 3000), (1.0, 10)])
def test_max_chunk_is_the_largest_chunk_within_budget(budget, prefix):
    n = TRUE.max_chunk(budget, prefix, limit=256)
    brute = max((k for k in range(257) if TRUE.chunk_cost(k, prefix) <= budget), default=0)
    assert n == brute


def make_sched(share=0.2, budget=256, **opts) -> Scheduler:
    cache = KVCache(KVCacheConfig(page_size=4, window=8, num_full_pages=1024, num_swa_pages=128))
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, bucket_edges=(40,), long_prefill_share=share,
                                     **opts), cache)


def long_chunk(plan) -> tuple[int, int]:
    (item,) = [s for s in plan.seqs if s.req_id == "long"]
    return item.num_new, item.start


def test_cold_start_keeps_long_chunks_small():
    s = make_sched()
    s.add_request(Request("long", list(range(3, 203)), SamplingParams(max_tokens=1)))
    plan = s.schedule()
    assert long_chunk(plan)[0] == COLD_LONG_CHUNK


def test_long_chunk_next_to_short_work_adds_at_most_share_of_predicted_step():
    s = make_sched(share=0.2)
    s.cost.fit = TRUE
    s.add_request(Request("long", list(range(3, 203)), SamplingParams(max_tokens=1)))
    s.add_request(Request("short", list(range(5, 25)), SamplingParams(max_tokens=1)))
    plan = s.schedule()
    n, start = long_chunk(plan)
    base = TRUE.predict(20, 20 * 20, 1)  # the short prefill alone
    by_time = TRUE.max_chunk(0.2 * base, start, 200)
    assert 1 <= n == min(by_time, 5)  # and at most 0.2 of the step's tokens: 20 * 0.2 / 0.8
    assert TRUE.chunk_cost(n, start) <= 0.2 * base


def test_per_sequence_cost_keeps_long_chunks_out_of_a_short_prefill_step_it_would_overrun():
    """Adding any long chunk costs per_seq on its own: when that alone exceeds the share, the short's step
    stays pure; with a budget above per_seq the chunk fills what is left."""
    steep = CostFit(fixed=4e-3, per_token=1.5e-4, per_pair=2e-7, per_seq=1.2e-3)
    for share, expect_long in ((0.1, False), (0.6, True)):
        s = make_sched(share=share)
        s.cost.fit = steep
        s.add_request(Request("long", list(range(3, 203)), SamplingParams(max_tokens=1)))
        s.add_request(Request("short", list(range(5, 25)), SamplingParams(max_tokens=1)))
        plan = s.schedule()
        longs = [x for x in plan.seqs if x.req_id == "long"]
        assert bool(longs) is expect_long and plan.num_prefill_seqs == 1 + len(longs)
        if longs:
            n, start = longs[0].num_new, longs[0].start
            budget = share * steep.predict(20, 20 * 20, 1)
            assert steep.chunk_cost(n, start) <= budget < steep.chunk_cost(n + 1, start)


def test_long_only_step_costs_at_most_long_step_cost_fixed_costs_when_not_interruptible():
    s = make_sched(share=0.2, interruptible_steps=False, long_step_cost=1.5)
    s.cost.fit = TRUE
    s.add_request(Request("long", list(range(3, 203)), SamplingParams(max_tokens=1)))
    plan = s.schedule()
    n, start = long_chunk(plan)
    assert TRUE.chunk_cost(n, start) <= 0.5 * TRUE.fixed < TRUE.chunk_cost(n + 1, start)
    assert not plan.interruptible
    # a fit so steep that not one token fits still moves a long-only step by one token
    s2 = make_sched(share=0.2, interruptible_steps=False)
    s2.cost.fit = CostFit(fixed=1e-3, per_token=1.0, per_pair=0.0)
    s2.add_request(Request("long", list(range(3, 203)), SamplingParams(max_tokens=1)))
    assert long_chunk(s2.schedule())[0] == 1


def test_adaptive_cap_off_keeps_the_token_share():
    cache = KVCache(KVCacheConfig(page_size=4, window=8, num_full_pages=1024, num_swa_pages=128))
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=256, bucket_edges=(40,), long_prefill_share=0.2,
                                  adaptive_long_cap=False), cache)
    s.cost.fit = TRUE
    s.add_request(Request("long", list(range(3, 203)), SamplingParams(max_tokens=1)))
    s.add_request(Request("short", list(range(5, 25)), SamplingParams(max_tokens=1)))
    assert long_chunk(s.schedule())[0] == 5  # 20 short tokens * 0.2 / 0.8


def test_interruptible_long_only_step_costs_at_most_long_step_cost_fixed_costs():
    s = make_sched(share=0.2, long_step_cost=3.0)
    s.cost.fit = TRUE
    s.add_request(Request("long", list(range(3, 203)), SamplingParams(max_tokens=1)))
    plan = s.schedule()
    n, start = long_chunk(plan)
    assert TRUE.chunk_cost(n, start) <= 2.0 * TRUE.fixed < TRUE.chunk_cost(n + 1, start)
    assert plan.interruptible
    s.add_request(Request("short", list(range(5, 25)), SamplingParams(max_tokens=1)))
    assert s.schedule().interruptible  # it still carries a long chunk


def test_decodes_next_to_a_long_prefill_get_the_long_step_budget_not_the_share():
    """Only a shorter request's first token is protected by the share: once it decodes, the long chunk next
    to it may fill the step up to long_step_cost fixed costs."""
    s = make_sched(share=0.05, long_step_cost=2.0)
    s.cost.fit = TRUE
    s.add_request(Request("short", list(range(5, 25)), SamplingParams(max_tokens=4)))
    first = s.schedule()
    s.update(first, {"short": SampledToken(7)})
    s.add_request(Request("long", list(range(3, 203)), SamplingParams(max_tokens=1)))
    plan = s.schedule()
    n, start = long_chunk(plan)
    assert [x.num_new for x in plan.seqs if x.req_id == "short"] == [1]
    assert TRUE.chunk_cost(n, start) <= TRUE.fixed < TRUE.chunk_cost(n + 1, start)
    only_short = make_sched(share=0.2)
    only_short.add_request(Request("short", list(range(5, 25)), SamplingParams(max_tokens=1)))
    assert not only_short.schedule().interruptible  # short work only: it always runs to the end


@pytest.mark.parametrize("adaptive", [True, False])
def test_long_prefill_waits_a_bounded_number_of_steps_next_to_short_work(adaptive):
    """However little budget the caps leave, a long prefill that got no token for LONG_STARVE_STEPS steps in a
    row is scheduled in the next one: a steady stream of short requests cannot starve it, and the short steps
    in between carry no long tokens."""
    s = make_sched(share=0.2, adaptive_long_cap=adaptive)
    s.cost.fit = CostFit(fixed=1e-3, per_token=1.0, per_pair=0.0)  # so steep that no long token fits
    s.add_request(Request("long", list(range(3, 203)), SamplingParams(max_tokens=1)))
    s.add_request(Request("long2", list(range(7, 207)), SamplingParams(max_tokens=1)))
    starved = longest = 0
    first = None
    for i in range(3 * (LONG_STARVE_STEPS + 1)):
        s.add_request(Request(f"short{i}", [5 + i], SamplingParams(max_tokens=1)))  # one token: no share
        pending = "long" in s.seqs or "long2" in s.seqs
        plan = s.schedule()
        n_long = sum(x.num_new for x in plan.seqs if x.req_id.startswith("long"))
        starved = 0 if n_long or not pending else starved + 1
        longest = max(longest, starved)
        if n_long and first is None:
            first = i
        s.update(plan, {x.req_id: SampledToken(9) for x in plan.seqs if x.sample})
    assert first == LONG_STARVE_STEPS  # the short steps before it carried no long token
    assert longest == LONG_STARVE_STEPS  # and no later wait was longer
