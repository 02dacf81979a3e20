"""Engine integration tests with the real tiny MiMo-V2 model, the real KV cache and the real runner.

References are independent of the engine's KV reuse: (a) the same requests through an engine with
the prefix cache disabled and roomy pools, (b) greedy decoding by full recompute (one fresh
forward over the whole sequence per token, no KV kept between tokens).
"""

import asyncio
import threading

import pytest
import torch

from libs.engine import LLM, AsyncEngine, EngineConfig, EngineCore, Request, SamplingParams
from libs.engine.request import FinishReason
from libs.engine.runner import direct_greedy
from libs.kvcache import EventKind, Tier
from libs.model import load_model, load_tokenizer

pytestmark = pytest.mark.integration

PAGE = 4


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, cfg = load_model(None)
    return model, cfg, load_tokenizer(None)


def make_core(tiny, **overrides) -> EngineCore:
    model, cfg, tok = tiny
    opts = dict(page_size=PAGE, num_full_pages=512, num_swa_pages=128, max_num_batched_tokens=64,
                bucket_edges=(), max_num_seqs=16)
    opts.update(overrides)
    return EngineCore(EngineConfig(**opts), model, cfg, tok)


def drain(core: EngineCore, max_steps: int = 5000) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return got
        for out in core.step():
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
        core.check_invariants()
    raise AssertionError("engine did not drain")


def assert_baseline(core: EngineCore) -> None:
    u = core.usage()
    for name in ("full", "swa", "host_full", "host_swa"):
        pool = getattr(u, name)
        assert pool.in_use == 0, f"{name} pool still has pages in use: {pool}"
        assert pool.free + pool.cached == pool.capacity, f"{name} pool accounting off: {pool}"
    assert not core.scheduler.seqs and not core.scheduler.running


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def test_engine_equals_full_recompute(tiny):
    model, cfg, _ = tiny
    core = make_core(tiny, max_num_batched_tokens=24)
    prompts = {f"q{i}": tokens(i, n) for i, n in enumerate((5, 17, 33, 41))}
    for rid, p in prompts.items():
        core.add_request(Request(rid, p, greedy(20)))
    got = drain(core)
    for rid, p in prompts.items():
        assert got[rid] == direct_greedy(model, cfg, p, 20), rid
    assert_baseline(core)


def test_short_lane_serves_a_late_short_prompt_early_with_fifo_outputs(tiny):
    """Real model: three 60-token prompts prefill in 16-token steps, a 6-token prompt arrives after two steps. With
    the short lane (one bucket of edges) its first token comes a few steps later, not after the long prompts;
    every output equals the plain FIFO engine's (bucket_edges=()) and full recompute."""
    model, cfg, _ = tiny
    prompts = {f"long{i}": tokens(80 + i, 60) for i in range(3)}
    short = tokens(90, 6)
    runs = {}
    for edges in ((10_000,), ()):
        core = make_core(tiny, bucket_edges=edges, max_num_batched_tokens=16)
        for rid, p in prompts.items():
            core.add_request(Request(rid, p, greedy(4)))
        got: dict[str, list[int]] = {}
        first = {}
        for i in range(200):
            if i == 2:
                core.add_request(Request("short", short, greedy(4)))
            if i > 2 and not core.has_work():
                break
            for out in core.step():
                got.setdefault(out.req_id, []).extend(out.new_token_ids)
                first.setdefault(out.req_id, i)
        runs[edges] = got, first
        assert_baseline(core)
    (got, first), (got_fifo, first_fifo) = runs[(10_000,)], runs[()]
    assert first["short"] - 2 <= 2 < first_fifo["short"] - 2  # 4 lane tokens a step; FIFO: after ~170 tokens
    assert got == got_fifo
    assert got["short"] == direct_greedy(model, cfg, short, 4)
    assert got["long0"] == direct_greedy(model, cfg, prompts["long0"], 4)


def conversations(n_conv: int = 6, n_turns: int = 3):
    """Multi-turn chats: two shared system prompts, and conversations 4, 5 branch off conversation 0."""
    systems = [tokens(1000 + s, 24) for s in range(2)]
    users = {(c, t): tokens(2000 + 10 * c + t, 5 + (c * 3 + t) % 8) for c in range(n_conv) for t in range(n_turns)}
    for c in (4, 5):
        users[(c, 0)] = users[(0, 0)]  # same first turn as conversation 0, then diverge
    return systems, users


def run_round(core: EngineCore, prompts: dict[str, list[int]], n_out: int) -> dict[str, list[int]]:
    for rid, p in prompts.items():
        core.add_request(Request(rid, p, greedy(n_out)))
    return drain(core)


@pytest.mark.parametrize(("load_mode", "kv_arena"), [("sync", False), ("inline", False), ("thread", False),
                                                   ("thread", True)])
def test_prefix_cache_under_memory_pressure_matches_cache_disabled(tiny, load_mode, kv_arena):
    """kv_arena: the same bytes as one arena (the device KV in one buffer of units, L2 copies through the
    unit tables)."""
    pressured = make_core(tiny, num_full_pages=72, num_swa_pages=36, num_host_full_pages=256,
                          num_host_swa_pages=128, max_num_batched_tokens=40, l2_backup_watermark=0.3,
                          l2_backup_pages=16, admission_decode_tokens=2, l2_load_mode=load_mode, kv_arena=kv_arena)
    assert (pressured.runner.kv.arena is not None) is kv_arena
    reference = make_core(tiny, enable_prefix_cache=False)
    systems, users = conversations()
    history = {c: list(systems[c % 2]) for c in range(6)}
    for turn in range(3):
        prompts = {f"c{c}t{turn}": history[c] + users[(c, turn)] for c in range(6)}
        got = run_round(pressured, prompts, n_out=22)  # outputs longer than the window (16)
        want = run_round(reference, prompts, n_out=22)
        assert got == want, f"turn {turn}"
        for c in range(6):
            history[c] = prompts[f"c{c}t{turn}"] + got[f"c{c}t{turn}"]
    stats = pressured.scheduler.stats
    assert stats.hit_tokens > 0, "the workload never hit the prefix cache"
    assert stats.preemptions > 0, "no preemption happened"
    assert stats.backed_up_pages > 0, "no L2 backup happened"
    assert stats.loaded_pages > 0, "no L2 load-back happened"
    assert_baseline(pressured)
    assert_baseline(reference)
    assert reference.scheduler.stats.hit_tokens == 0
    events = pressured.drain_kv_events()
    stored = [e for e in events if e.kind is EventKind.STORED and e.tier is Tier.DEVICE]
    flags = [f for e in stored for f in e.swa_checkpoint]
    assert True in flags and False in flags, "expected both SWA checkpoints and tombstoned blocks"
    assert any(e.kind is EventKind.REMOVED and e.tier is Tier.DEVICE for e in events), "no device eviction"
    assert [e.event_id for e in events] == list(range(events[0].event_id, events[0].event_id + len(events)))


@pytest.mark.parametrize("when", ["mid_prefill", "mid_decode"])
def test_abort_leaks_nothing(tiny, when):
    core = make_core(tiny, max_num_batched_tokens=8, num_host_full_pages=64, num_host_swa_pages=32)
    core.add_request(Request("victim", tokens(7, 30), greedy(30)))
    core.add_request(Request("other", tokens(8, 6), greedy(4)))
    outs = core.step()
    if when == "mid_decode":
        while not core.scheduler.seqs["victim"].is_decoding:
            outs += core.step()
        outs += core.step()
    assert core.scheduler.seqs["victim"].is_decoding == (when == "mid_decode")
    assert core.usage().full.in_use > 0
    assert core.abort("victim")
    outs += core.step()
    final = [o for o in outs if o.req_id == "victim" and o.finished]
    assert len(final) == 1 and final[0].finish_reason is FinishReason.ABORT
    outs += [o for step_outs in iter(lambda: core.step() if core.has_work() else None, None) for o in step_outs]
    assert sum(len(o.new_token_ids) for o in outs if o.req_id == "other") == 4
    assert_baseline(core)


def test_prefill_only_then_release(tiny):
    model, cfg, _ = tiny
    core = make_core(tiny)
    p = tokens(9, 21)
    core.add_request(Request("pf", p, greedy(10), prefill_only=True))
    outs = core.step()
    assert outs[0].finish_reason is FinishReason.PREFILLED
    held = core.held_prefill("pf")
    assert held.num_computed == len(p) and held.token_ids[-1] == outs[0].new_token_ids[0]
    assert held.token_ids[-1] == direct_greedy(model, cfg, p, 1)[0]
    assert len(held.full_pages) == -(-len(p) // PAGE)
    core.release("pf")
    assert_baseline(core)
    core.add_request(Request("again", p + [held.token_ids[-1]], greedy(2)))
    drain(core)
    assert core.scheduler.stats.hit_tokens > 0  # the released prefill was cached


def test_llm_text_prompts_stop_strings_and_logprobs(tiny):
    model, cfg, tok = tiny
    llm = LLM.from_core(make_core(tiny))
    ref = direct_greedy(model, cfg, tok.encode("hello world"), 12)
    text = tok.decode(ref)
    stop_at = text[3:5]
    outs = llm.generate(["hello world", "hello world"],
                        [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2),
                         SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop_at])])
    assert list(outs[0].token_ids) == ref and outs[0].finish_reason is FinishReason.LENGTH
    assert len(outs[0].logprobs) == 12 and all(len(lp.top) == 2 for lp in outs[0].logprobs)
    assert outs[0].logprobs[0].top[0][0] == ref[0]
    assert outs[1].finish_reason is FinishReason.STOP and stop_at in outs[1].text
    assert list(outs[1].token_ids) == ref[: len(outs[1].token_ids)]


def test_seeded_sampling_is_independent_of_batching_and_cache(tiny):
    p = SamplingParams(max_tokens=15, temperature=0.9, top_p=0.95, seed=123, ignore_eos=True)
    prompt = tokens(11, 19)
    alone = LLM.from_core(make_core(tiny)).generate([prompt], p)[0].token_ids
    crowd = LLM.from_core(make_core(tiny, max_num_batched_tokens=16)).generate(
        [tokens(12, 30), prompt, tokens(13, 9)],
        [SamplingParams(max_tokens=15, temperature=1.0), p, SamplingParams(max_tokens=5)])[1].token_ids
    assert alone == crowd


def test_add_request_rejects_what_can_never_fit(tiny):
    core = make_core(tiny, num_full_pages=8, kv_arena=False)  # the static full pool: 8 pages of 4 tokens
    with pytest.raises(ValueError, match="KV pages"):
        core.add_request(Request("big", tokens(1, 30), greedy(10)))


async def test_async_engine_streams_and_cancel_aborts(tiny):
    core = make_core(tiny)
    model, cfg, _ = tiny
    prompt = tokens(21, 12)
    async with AsyncEngine(core, output_timeout_s=60) as engine:
        streamed = [o async for o in engine.generate(Request("s1", prompt, greedy(6)))]
        assert [o.new_token_ids[0] for o in streamed] == direct_greedy(model, cfg, prompt, 6)
        assert streamed[-1].finished and not any(o.finished for o in streamed[:-1])

        async def consume_two():
            n = 0
            async for _ in engine.generate(Request("s2", tokens(22, 40), greedy(200))):
                n += 1
                if n == 2:
                    return n
        assert await consume_two() == 2  # leaving the loop early aborts the request
        # long enough (1800 tokens) that the faster engine cannot finish it before the cancel below
        task = asyncio.create_task(_consume_all(engine, Request("s3", tokens(23, 40), greedy(1800))))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.call(lambda c: None)  # abort commands run before this one
        for _ in range(600):  # bounded (30 s); the early-exit generator is closed by the loop's finalizer
            if not await engine.call(lambda c: c.has_work()):
                break
            await asyncio.sleep(0.05)
        await engine.call(lambda c: assert_baseline(c))


async def test_async_engine_survives_a_caller_that_stops_waiting_for_its_command(tiny):
    """A call whose caller is cancelled while the command runs (a client left) still runs to its end; the
    loop must not die setting the result on the cancelled future."""
    async with AsyncEngine(make_core(tiny), output_timeout_s=60) as engine:
        started, go, ran = asyncio.Event(), threading.Event(), []
        loop = asyncio.get_running_loop()

        def slow(core):
            loop.call_soon_threadsafe(started.set)
            go.wait(10)
            ran.append(True)
            return 1

        waiting = asyncio.ensure_future(engine.call(slow))
        queued = asyncio.ensure_future(engine.call(lambda core: ran.append("queued")))
        await asyncio.wait_for(started.wait(), 10)
        waiting.cancel()
        queued.cancel()  # gave up before its command started: it runs anyway (an abort must not be lost)
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert await engine.call(lambda core: 7) == 7 and engine.is_running
        assert ran == [True, "queued"]
        out = [o async for o in engine.generate(Request("after", tokens(24, 8), greedy(2)))]
        assert out[-1].finished


async def _consume_all(engine, req):
    return [o async for o in engine.generate(req)]


class LayerCountdown:
    """Interrupt check that fires on its n-th poll (two per decoder layer of an interruptible step: before the
    layer and before its MLP)."""

    def __init__(self, n: int) -> None:
        self.n, self.polls = n, 0

    def __call__(self) -> bool:
        self.polls += 1
        return self.polls == self.n


@pytest.mark.parametrize("fire_at", [1, 2, 7])
def test_interrupted_long_steps_leave_outputs_and_pools_unchanged(tiny, fire_at):
    """A step of long prefill chunks stopped between layers (its K/V partly written, nothing committed) is
    redone by the next step; the outputs equal full recompute and the pools return to their baseline."""
    model, cfg, _ = tiny
    core = make_core(tiny, bucket_edges=(32,), max_num_batched_tokens=16, num_swa_pages=64)
    long_prompt = tokens(40, 90)  # several windows long: partial SWA writes would show if they leaked
    core.add_request(Request("long", long_prompt, greedy(5)))
    got: dict[str, list[int]] = {}
    interrupted = 0
    while core.has_work():
        seq = core.scheduler.seqs.get("long")
        before = seq.num_computed if seq is not None else None
        check = LayerCountdown(fire_at)
        outs = core.step(interrupt=check if interrupted < 3 else None)
        if check.polls >= fire_at and not outs:  # it fired
            interrupted += 1
            assert core.scheduler.seqs["long"].num_computed == before  # nothing committed
            core.check_invariants()
            if interrupted == 2:  # a short request arrives: the next step serves it next to a capped chunk
                core.add_request(Request("short", tokens(41, 6), greedy(3)))
        for out in outs:
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
        core.check_invariants()
    assert interrupted == 3 and core.num_interrupted == 3
    assert got["long"] == direct_greedy(model, cfg, long_prompt, 5)
    assert got["short"] == direct_greedy(model, cfg, tokens(41, 6), 3)
    assert_baseline(core)


def test_only_steps_with_long_prefill_are_interrupted(tiny):
    model, cfg, _ = tiny
    core = make_core(tiny, bucket_edges=(32,), max_num_batched_tokens=16)
    short = tokens(42, 6)
    core.add_request(Request("short", short, greedy(12)))
    got: dict[str, list[int]] = {}
    for _ in range(3):  # short work only (its prefill, then decodes): never stopped
        for out in core.step(interrupt=lambda: True):
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert core.num_interrupted == 0 and len(got["short"]) == 3
    core.add_request(Request("long", tokens(43, 80), greedy(2)))
    assert core.step(interrupt=lambda: True) == []  # the short's decode next to a long chunk: stopped, redone
    assert core.num_interrupted == 1
    for out in core.step():
        got.setdefault(out.req_id, []).extend(out.new_token_ids)
    for rid, toks in drain(core).items():
        got.setdefault(rid, []).extend(toks)
    assert got["short"] == direct_greedy(model, cfg, short, 12)
    assert core.is_urgent(Request("x", tokens(44, 31), greedy(1)))
    assert not core.is_urgent(Request("y", tokens(44, 32), greedy(1)))
    assert not make_core(tiny).is_urgent(Request("z", tokens(44, 3), greedy(1)))  # no buckets: nothing to jump
    assert_baseline(core)


async def test_async_engine_short_request_during_long_prefill(tiny):
    """Shorts submitted while a long prompt prefills (their arrival may stop long steps between layers):
    every output still equals full recompute."""
    model, cfg, _ = tiny
    core = make_core(tiny, bucket_edges=(32,), max_num_batched_tokens=16, num_swa_pages=64)
    long_prompt = tokens(45, 160)
    async with AsyncEngine(core, output_timeout_s=60) as engine:
        long_task = asyncio.create_task(_consume_all(engine, Request("long", long_prompt, greedy(4))))
        shorts = []
        for i in range(4):
            await asyncio.sleep(0.01)
            shorts.append(asyncio.create_task(_consume_all(engine, Request(f"s{i}", tokens(46 + i, 5), greedy(3)))))
        for i, task in enumerate(shorts):
            assert [o.new_token_ids[0] for o in await task] == direct_greedy(model, cfg, tokens(46 + i, 5), 3)
        assert [o.new_token_ids[0] for o in await long_task] == direct_greedy(model, cfg, long_prompt, 4)
        await engine.call(lambda c: assert_baseline(c))


@pytest.mark.parametrize("pressure", [False, True])
def test_swa_window_rebuild_hits_match_cache_disabled(tiny, pressure):
    """Requests branching deep inside a cached prompt, far past its last SWA checkpoint, start from a window
    rebuilt out of the cached full KV; their outputs equal a cache-disabled run (and full recompute)."""
    model, cfg, _ = tiny
    opts = dict(num_full_pages=150, num_swa_pages=40, max_num_batched_tokens=48) if pressure else {}
    core = make_core(tiny, **opts)
    reference = make_core(tiny, enable_prefix_cache=False)
    stem = tokens(60, 240)
    rounds = [{"a": stem + tokens(61, 9)},
              {f"b{i}": stem[:120 + 40 * i] + tokens(62 + i, 7) for i in range(3)},
              {f"c{i}": stem[:200 + 8 * i] + tokens(70 + i, 5) for i in range(2)}]
    for prompts in rounds:
        got, want = run_round(core, prompts, 6), run_round(reference, prompts, 6)
        assert got == want
    assert core.cache.rebuild_stats().admitted >= 3
    assert got["c0"] == direct_greedy(model, cfg, rounds[2]["c0"], 6)
    assert_baseline(core)
    assert_baseline(reference)


def test_engines_over_one_model_do_not_pile_up_hooks(tiny):
    """Each engine hooks the shared model's layers (layer-wise loads, step interrupts); a closed or collected
    engine takes its hooks with it, so later engines' forwards do not slow down and old pools are freed."""
    import gc

    model = tiny[0]
    before = len(model.model.layers[0]._forward_pre_hooks)
    cores = [make_core(tiny) for _ in range(3)]
    assert len(model.model.layers[0]._forward_pre_hooks) == before + 3
    cores[0].close()
    cores[0].close()  # idempotent
    assert len(model.model.layers[0]._forward_pre_hooks) == before + 2
    del cores
    gc.collect()
    assert len(model.model.layers[0]._forward_pre_hooks) == before
