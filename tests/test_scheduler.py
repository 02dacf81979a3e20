"""Pure scheduler over the real (pure) KV cache: budgets, buckets, preemption, abort, accounting.

No model: a deterministic fake "model" picks the next token from the sequence content, so a
recomputed (preempted) sequence must continue with exactly the same tokens.
"""

import subprocess
import sys

import pytest

from libs.engine.plan import BatchPlan
from libs.engine.request import FinishReason, Request, SamplingParams
from libs.engine.scheduler import SampledToken, Scheduler, SchedulerConfig, SeqStatus
from libs.kvcache import KVCache, KVCacheConfig

pytestmark = pytest.mark.unit

PAGE, WINDOW = 4, 8


def fake_next(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 97 + 3


def make(full=256, swa=64, budget=32, edges=(), share=0.25, max_seqs=16, cache=True, decode_reserve=None):
    cache_obj = KVCache(KVCacheConfig(page_size=PAGE, window=WINDOW, num_full_pages=full, num_swa_pages=swa,
                                      enable_prefix_cache=cache))
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, bucket_edges=edges,
                          long_prefill_share=share, admission_decode_tokens=decode_reserve)
    return Scheduler(cfg, cache_obj)


def step(sched: Scheduler) -> tuple[BatchPlan, list]:
    plan = sched.schedule()
    sampled = {s.req_id: SampledToken(fake_next(sched.seqs[s.req_id].token_ids[: s.kv_len]))
               for s in plan.seqs if s.sample}
    outs = sched.update(plan, sampled)
    sched.check_invariants()
    return plan, outs


def run_all(sched: Scheduler, max_steps=2000) -> dict[str, list[int]]:
    produced: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_work():
            return produced
        _, outs = step(sched)
        for o in outs:
            produced.setdefault(o.req_id, []).extend(o.new_token_ids)
    raise AssertionError("scheduler did not drain")


def reference_output(prompt: list[int], n: int) -> list[int]:
    toks, out = list(prompt), []
    for _ in range(n):
        out.append(fake_next(toks))
        toks.append(out[-1])
    return out


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 251 + 1 for i in range(n)]


def assert_baseline(sched: Scheduler) -> None:
    u = sched.cache.usage()
    for pool in (u.full, u.swa):
        assert pool.in_use == 0, f"pages still in use after all requests ended: {u}"
        assert pool.free + pool.cached == pool.capacity


def test_scheduler_module_imports_no_torch():
    code = "import sys, libs.engine.scheduler, libs.kvcache; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_chunked_prefill_respects_budget_and_samples_on_last_chunk():
    s = make(budget=16)
    s.add_request(Request("a", prompt(1, 50), SamplingParams(max_tokens=3)))
    chunks, samples = [], []
    while s.has_work():
        plan, _ = step(s)
        assert plan.num_tokens <= 16
        chunks += [x.num_new for x in plan.seqs]
        samples += [x.sample for x in plan.seqs]
    assert chunks == [16, 16, 16, 2, 1, 1]
    assert samples == [False, False, False, True, True, True]


def test_decodes_go_first_and_all_outputs_match_reference():
    s = make(budget=20)
    prompts = {f"r{i}": prompt(i, 10 + 7 * i) for i in range(5)}
    for rid, p in prompts.items():
        s.add_request(Request(rid, p, SamplingParams(max_tokens=6)))
    for _ in range(200):
        if not s.has_work():
            break
        decoding_before = {q.req_id for q in s.running if q.is_decoding}
        plan, _ = step(s)
        assert plan.num_tokens <= 20
        scheduled = {x.req_id for x in plan.seqs if not x.is_prefill}
        assert decoding_before <= scheduled  # every decoding sequence got its token
    assert_baseline(s)


def test_outputs_match_reference_and_max_num_seqs_holds():
    s = make(budget=24, max_seqs=2)
    prompts = {f"r{i}": prompt(i, 9 + 5 * i) for i in range(6)}
    for rid, p in prompts.items():
        s.add_request(Request(rid, p, SamplingParams(max_tokens=5)))
    got = run_all(s)
    assert got == {rid: reference_output(p, 5) for rid, p in prompts.items()}
    assert_baseline(s)


def test_buckets_put_short_first_and_cap_long_share():
    s = make(budget=32, edges=(40,), share=0.25)
    s.add_request(Request("long", prompt(1, 120), SamplingParams(max_tokens=2)))
    s.add_request(Request("short", prompt(2, 12), SamplingParams(max_tokens=2)))
    plan, _ = step(s)
    by_id = {x.req_id: x for x in plan.seqs}
    assert by_id["short"].num_new == 12 and by_id["short"].sample
    # the long prefill may take 25% of the step: 12 short tokens -> at most 4 long ones
    assert 1 <= by_id["long"].num_new <= 4
    plan, _ = step(s)  # short now decodes; nothing shorter waits: the long one takes the rest
    by_id = {x.req_id: x for x in plan.seqs}
    assert by_id["short"].num_new == 1 and by_id["long"].num_new == 31


def test_without_buckets_long_request_delays_short_one():
    s = make(budget=32, edges=())
    s.add_request(Request("long", prompt(1, 120), SamplingParams(max_tokens=2)))
    s.add_request(Request("short", prompt(2, 12), SamplingParams(max_tokens=2)))
    first_token_step = {}
    for i in range(20):
        _, outs = step(s)
        for o in outs:
            first_token_step.setdefault(o.req_id, i)
    assert first_token_step["short"] >= 3  # waited behind most of the long prefill (FCFS)


def test_bucket_uses_uncached_tokens():
    s = make(budget=64, edges=(40,))
    base = prompt(3, 60)
    got = run_all_with(s, [Request("t1", base, SamplingParams(max_tokens=4))])
    follow = base + got["t1"] + prompt(4, 6)
    s.add_request(Request("t2", follow, SamplingParams(max_tokens=2)))
    seq = s.seqs["t2"]
    assert len(follow) > 40 and seq.bucket == 0  # most of it is a prefix hit
    run_all(s)
    assert_baseline(s)


def run_all_with(s, reqs):
    for r in reqs:
        s.add_request(r)
    return run_all(s)


@pytest.mark.parametrize("cache", [False, True])
def test_preemption_under_memory_pressure_keeps_outputs_identical(cache):
    # 6 requests needing up to 14 full pages each; admission reserves no decode growth, so decode
    # runs the 32-page pool dry and must preempt (recompute) instead of failing or dropping.
    s = make(full=32, swa=48, budget=48, max_seqs=8, cache=cache, decode_reserve=0)
    prompts = {f"p{i}": prompt(10 + i, 14 + 3 * i) for i in range(6)}
    got = run_all_with(s, [Request(r, p, SamplingParams(max_tokens=24)) for r, p in prompts.items()])
    assert got == {rid: reference_output(p, 24) for rid, p in prompts.items()}
    assert s.stats.preemptions > 0
    assert_baseline(s)


def test_full_reservation_never_preempts():
    s = make(full=32, swa=48, budget=48, max_seqs=8, cache=False)
    prompts = {f"p{i}": prompt(10 + i, 14 + 3 * i) for i in range(6)}
    got = run_all_with(s, [Request(r, p, SamplingParams(max_tokens=24)) for r, p in prompts.items()])
    assert got == {rid: reference_output(p, 24) for rid, p in prompts.items()}
    assert s.stats.preemptions == 0
    assert_baseline(s)


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "mid_decode"])
def test_abort_frees_everything(when):
    s = make(budget=8, full=64, swa=32)
    s.add_request(Request("x", prompt(5, 30), SamplingParams(max_tokens=10)))
    s.add_request(Request("y", prompt(6, 9), SamplingParams(max_tokens=10)))
    if when != "waiting":
        step(s)
        assert s.seqs["x"].status is SeqStatus.RUNNING
    if when == "mid_decode":
        while not s.seqs["x"].is_decoding:
            step(s)
        step(s)
    assert s.abort("x")
    assert not s.abort("x")
    _, outs = step(s)
    aborted = [o for o in outs if o.req_id == "x"]
    assert aborted and aborted[0].finish_reason is FinishReason.ABORT and aborted[0].finished
    assert s.abort("y")
    step(s)
    assert not s.has_work()
    assert_baseline(s)


def test_prefill_only_holds_kv_until_release():
    s = make(budget=64, cache=False)
    s.add_request(Request("pf", prompt(7, 20), SamplingParams(max_tokens=50), prefill_only=True))
    _, outs = step(s)
    assert outs[0].finish_reason is FinishReason.PREFILLED and len(outs[0].new_token_ids) == 1
    assert s.seqs["pf"].status is SeqStatus.HELD
    assert s.cache.usage().full.in_use > 0
    s.release("pf", cache=False)
    assert_baseline(s)
    with pytest.raises(KeyError, match="pf"):
        s.release("pf")


def test_duplicate_id_and_stop_strings_without_tokenizer_rejected():
    s = make()
    s.add_request(Request("d", [1, 2], SamplingParams()))
    with pytest.raises(ValueError, match="already"):
        s.add_request(Request("d", [1, 2], SamplingParams()))
    with pytest.raises(ValueError, match="tokenizer"):
        s.add_request(Request("e", [1, 2], SamplingParams(stop=["x"])))


def test_config_validation():
    with pytest.raises(ValueError, match="long_prefill_share"):
        SchedulerConfig(long_prefill_share=0)
    with pytest.raises(ValueError, match="strictly increasing"):
        SchedulerConfig(bucket_edges=(10, 5))
    with pytest.raises(ValueError, match="served_buckets"):
        SchedulerConfig(bucket_edges=(10,), served_buckets=(2,))


def test_long_prefill_max_tokens_caps_long_chunks_even_alone():
    cache_obj = KVCache(KVCacheConfig(page_size=PAGE, window=WINDOW, num_full_pages=256, num_swa_pages=64))
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=32, bucket_edges=(40,), long_prefill_max_tokens=10),
                  cache_obj)
    s.add_request(Request("long", prompt(1, 100), SamplingParams(max_tokens=1)))
    s.add_request(Request("short", prompt(2, 20), SamplingParams(max_tokens=1)))
    sizes = []
    while s.has_work():
        plan, _ = step(s)
        sizes += [x.num_new for x in plan.seqs if x.req_id == "long"]
    assert max(sizes) <= 10 and sum(sizes) == 100


def first_token_steps(s: Scheduler, arrivals: dict[int, list[Request]], max_steps=2000):
    """Run to the end, adding arrivals[i] before step i; the step index of each request's first token and its
    outputs."""
    first, produced = {}, {}
    for i in range(max_steps):
        for r in arrivals.get(i, ()):
            s.add_request(r)
        if not s.has_work() and i > max(arrivals):
            return first, produced
        _, outs = step(s)
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.req_id, i)
            produced.setdefault(o.req_id, []).extend(o.new_token_ids)
    raise AssertionError("scheduler did not drain")


def test_short_prompt_behind_long_ones_in_its_bucket_gets_the_short_lane():
    """Six 200-token prompts prefill (one bucket, 16-token steps); a 12-token prompt arriving later gets its first
    token within 12 / (0.25 x 16) steps instead of queueing behind all of them, and every output equals the
    plain FIFO run's."""
    def reqs():
        return {0: [Request(f"long{i}", prompt(20 + i, 200), SamplingParams(max_tokens=3)) for i in range(6)],
                3: [Request("short", prompt(30, 12), SamplingParams(max_tokens=3))]}

    lane = make(budget=16, edges=(10_000,))
    fifo = make(budget=16, edges=())
    first, got = first_token_steps(lane, reqs())
    first_fifo, got_fifo = first_token_steps(fifo, reqs())
    assert first["short"] - 3 <= 3  # 4 lane tokens a step: 3 steps
    assert first_fifo["short"] - 3 > 60  # FIFO: behind 6 x 200 tokens
    assert first["long0"] <= first_fifo["long0"] + 4  # the oldest is barely slowed
    assert got == got_fifo == {r.req_id: reference_output(r.prompt_token_ids, 3) for rs in reqs().values() for r in rs}
    assert_baseline(lane)


def test_short_lane_never_starves_the_oldest_prefill():
    """A new 4-token prompt every step (each would win a shortest-first order): the oldest 200-token prompt still
    gets the rest of every step and its first token comes within 200 / (0.75 x 16) steps (+ slack)."""
    s = make(budget=16, edges=(10_000,))
    arrivals = {0: [Request("long", prompt(40, 200), SamplingParams(max_tokens=1)),
                    Request("long2", prompt(41, 200), SamplingParams(max_tokens=1))]}
    for i in range(40):
        arrivals.setdefault(i, []).append(Request(f"s{i}", prompt(50 + i, 4), SamplingParams(max_tokens=1)))
    first, got = first_token_steps(s, arrivals)
    assert first["long"] <= 200 // 12 + 2
    assert all(first[f"s{i}"] - i <= 1 for i in range(40))  # and the shorts pass in the lane
    assert got["long"] == reference_output(prompt(40, 200), 1)
    assert_baseline(s)
