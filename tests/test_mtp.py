"""MTP speculative decoding (#17): greedy outputs with MTP equal MTP off, the rollback leaves the pools as
without it, the draft KV is part of the pools (sizing, page ids), and the peers' bugs each have a test.

Two drafters: the real MTP blocks (random weights: they draft, rarely right) and an oracle that runs the real
blocks (their KV paths are exercised) and then replaces the drafts by the true continuation with some tokens
corrupted, so verification accepts 0..k drafts in mixed batches and rolls back the rest.
"""

import random
from types import SimpleNamespace

import pytest
import torch

from libs.engine import EngineCore, Request, SamplingParams
from libs.engine.gcache_tier import kv_layout
from libs.engine.mtp import DraftSpan, HiddenRing, block_inputs, check_draft_layers, greedy_accept
from libs.kvcache import KVCache, KVCacheConfig
from libs.kvcache.config import plan_pools
from libs.model.paged import BatchMeta, KVPools
from tests.test_engine import assert_baseline, conversations, drain, greedy, make_core, tiny, tokens

pytestmark = pytest.mark.integration
__all__ = ["tiny"]  # the fixture, shared with test_engine

K = 3


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model's matmuls are too small for a second thread: on a busy 2-core machine two threads make
    each one ~100x slower. Restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def oracle(core: EngineCore, truth: dict[str, list[int]], right: float, seed: int = 0) -> None:
    """Make `core` draft the true continuation (`truth`, read at each step), each token right with
    probability `right`."""
    real, rng = core._draft, random.Random(seed)

    def draft(plan):
        real(plan)
        for s in core.scheduler.running:
            if s.drafts:
                gen = len(s.token_ids) - s.num_prompt
                want = truth[s.req_id][gen:gen + len(s.drafts)]
                s.drafts = [t if rng.random() < right else (t + 1) % 250 for t in want] or s.drafts
    core._draft = draft  # type: ignore[method-assign]


def run(core: EngineCore, prompts: dict[str, list[int]], n_out: int) -> dict[str, list[int]]:
    for rid, p in prompts.items():
        core.add_request(Request(rid, p, greedy(n_out)))
    return drain(core)


def test_greedy_accept_is_exact():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 9]) == ((5, 6), 7)
    assert greedy_accept([4, 6, 7, 8], [5, 6, 7]) == ((), 4)
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == ((5, 6, 7), 8)


@pytest.mark.parametrize("right", [None, 0.7, 1.0])
def test_greedy_mtp_equals_off_under_pressure_with_prefix_hits(tiny, right):
    """Multi-turn chats through small pools (preemption by recompute, evictions, tombstones) with MTP on equal
    MTP off, turn by turn; prefix hits are the same tokens; pools end at their baseline. right=None: the real
    (random) MTP blocks draft. On the two static pools (kv_arena=False): both engines then hold the same pages
    (the draft layers are extra layers of the same SWA pages), so the same evictions and hits; on one arena of
    the pages' bytes an SWA page with draft layers takes more units (tests/test_engine_arena.py covers MTP
    there)."""
    opts = dict(num_full_pages=64, num_swa_pages=28, max_num_batched_tokens=40, admission_decode_tokens=2,
                kv_arena=False)
    off = make_core(tiny, **opts)
    on = make_core(tiny, speculative_tokens=K, **opts)
    systems, users = conversations()
    history = {c: list(systems[c % 2]) for c in range(6)}
    truth: dict[str, list[int]] = {}
    if right is not None:
        oracle(on, truth, right)
    for turn in range(2):
        prompts = {f"c{c}t{turn}": history[c] + users[(c, turn)] for c in range(6)}
        want = run(off, prompts, n_out=22)
        truth.update(want)
        got = run(on, prompts, n_out=22)
        assert got == want, f"turn {turn}"
        for c in range(6):
            history[c] = prompts[f"c{c}t{turn}"] + got[f"c{c}t{turn}"]
    st, base = on.scheduler.stats, off.scheduler.stats
    assert st.preemptions > 0, "no preemption happened"
    assert st.hit_tokens == base.hit_tokens > 0, "prefix hits differ from MTP off (or none happened)"
    assert on.cache.cache_stats().evictions["swa"][0] > 0 or on.cache.cache_stats().evictions["full"][0] > 0
    spec = on.spec_stats()
    assert spec is not None and spec.drafted_tokens > 0
    if right == 1.0:
        assert spec.accepted_len > 2.0, spec
    if right == 0.7:
        assert len([n for n in spec.accept_hist if n]) >= 3, f"want mixed acceptance lengths, got {spec}"
    assert_baseline(on)
    assert_baseline(off)


def test_mtp_equals_off_across_prefill_chunks_window_and_stops(tiny):
    """Prompts longer than the window and than a step's token budget, outputs that hit max_tokens inside an
    accepted run, one prefill-free hit of a finished request's whole prompt + output."""
    off = make_core(tiny, max_num_batched_tokens=24)
    on = make_core(tiny, max_num_batched_tokens=24, speculative_tokens=K)
    prompts = {f"p{i}": tokens(300 + i, n) for i, n in enumerate((3, 17, 40, 71))}
    want = {}
    for n_out in (1, 2, 5, 23):
        batch = {f"{rid}n{n_out}": p for rid, p in prompts.items()}
        want.update(run(off, batch, n_out))
    oracle(on, want, 0.9)
    for n_out in (1, 2, 5, 23):
        batch = {f"{rid}n{n_out}": p for rid, p in prompts.items()}
        assert run(on, batch, n_out) == {r: want[r] for r in batch}
    assert on.scheduler.stats.hit_tokens == off.scheduler.stats.hit_tokens
    assert_baseline(on)


def test_rollback_frees_the_rejected_pages():
    """reserve(k + 1) then commit(1) and trim: the pages past the computed end are free again, the window is
    the one of a sequence that never wrote them, and the promise still covers the growth."""
    cache = KVCache(KVCacheConfig(page_size=4, window=8, num_full_pages=32, num_swa_pages=16), audit_tokens=True)
    base = cache.usage()
    tokens_ = list(range(7))
    hit = cache.match(tokens_)
    assert cache.admit("s", tokens_, hit, max_new_tokens=12).ok
    assert cache.reserve("s", 6)
    cache.commit("s", 6, (9,))  # prompt prefilled (6 of 7 tokens have KV, the last is the next input)
    ref = KVCache(KVCacheConfig(page_size=4, window=8, num_full_pages=32, num_swa_pages=16))
    assert ref.admit("s", tokens_, ref.match(tokens_), max_new_tokens=12).ok
    assert ref.reserve("s", 6)
    ref.commit("s", 6, (9,))
    assert cache.reserve("s", 1 + 5)  # the last token + 5 drafts: positions 6..11 (pages 1, 2)
    assert len(cache.page_tables("s")[0]) == 3
    cache.commit("s", 2, (3, 4))  # one draft accepted
    assert cache.trim("s") == 1
    assert ref.reserve("s", 2)
    ref.commit("s", 2, (3, 4))
    assert [len(t) for t in cache.page_tables("s")] == [len(t) for t in ref.page_tables("s")]
    assert [p >= 0 for p in cache.page_tables("s")[1]] == [p >= 0 for p in ref.page_tables("s")[1]]
    assert cache.usage() == ref.usage()
    cache.check_invariants()
    cache.abort("s")
    assert cache.usage() == base


def test_draft_kv_is_counted_in_pool_sizing(tiny):
    """Peer bug: draft KV left out of the SWA pool sizing (OOM at launch). The bytes the engine allocates are the
    layout's (the draft layers included), so a plan from a byte budget fits it."""
    model, cfg, _ = tiny
    core = make_core(tiny, speculative_tokens=K, num_full_pages=40, num_swa_pages=24)
    layout = kv_layout(cfg, torch.float32, draft_layers=K)
    assert layout.swa_layers == len(cfg.swa_layers) + K
    allocated = sum(core.runner.kv.pool_bytes().values())  # (read off the tensors: two pools or one arena)
    assert allocated == 40 * layout.full_page_bytes(4) + 24 * layout.swa_page_bytes(4)
    budget = allocated
    plan = plan_pools(budget, layout, 4, cfg.sliding_window, expected_seq_tokens=64)
    assert plan.num_full_pages * layout.full_page_bytes(4) + plan.num_swa_pages * layout.swa_page_bytes(4) <= budget
    without = kv_layout(cfg, torch.float32)
    assert without.swa_page_bytes(4) < layout.swa_page_bytes(4)


def test_draft_pool_has_the_target_pages(tiny):
    """Peer bug: a draft pool smaller than the target's (out of bounds). The draft layers index the SWA pool with
    the target's page ids, so every SWA page id the cache hands out is valid in them: fill the pool to its last
    page with MTP on. (The static pools' tensors: on one arena every page reads through the unit tables.)"""
    core = make_core(tiny, speculative_tokens=K, num_full_pages=64, num_swa_pages=12, max_num_seqs=2,
                     kv_arena=False)
    n_swa = len(core.model_config.swa_layers)
    assert core.runner.kv.swa_k.shape[:2] == (n_swa + K, 12)
    assert core._kv_mtp is not None and core._kv_mtp.swa_k.shape[:2] == (K, 12)
    run(core, {f"r{i}": tokens(400 + i, 30) for i in range(4)}, 20)
    assert core.usage().swa.capacity == 12
    assert_baseline(core)


def test_each_draft_uses_its_own_mtp_block(tiny, monkeypatch):
    """Peer bug: every draft layer ran the same weights. Draft j goes through MTP block j (its own weights and
    its own KV layer), and the blocks' weights differ."""
    model, cfg, _ = tiny
    layers = model.model.mtp.layers
    for a in range(K):
        for b in range(a + 1, K):
            assert not torch.equal(layers[a].eh_proj.weight, layers[b].eh_proj.weight)
    steps: list[int] = []
    real = type(model).forward_mtp

    def spy(self, step, *args, **kwargs):
        steps.append(step)
        return real(self, step, *args, **kwargs)
    monkeypatch.setattr(type(model), "forward_mtp", spy)
    core = make_core(tiny, speculative_tokens=K)
    run(core, {"a": tokens(7, 9)}, 6)
    assert steps[:K] == list(range(K)) and set(steps) == set(range(K))


def test_a_model_without_mtp_layers_refuses_to_draft():
    with pytest.raises(ValueError, match="no MTP layers"):
        check_draft_layers(2, SimpleNamespace(num_mtp_layers=0))
    assert check_draft_layers(0, SimpleNamespace(num_mtp_layers=0)) == 0
    assert check_draft_layers(5, SimpleNamespace(num_mtp_layers=3)) == 5


@pytest.mark.parametrize("kv_arena", [False, True])
def test_speculative_tokens_beyond_mtp_layers_reuse_the_last_block(tiny, monkeypatch, kv_arena):
    """k = 5 on the tiny model's 3 blocks: steps 3 and 4 run block 2 again, chained, each step with its own KV
    layer (the draft pools have 5). Greedy outputs equal MTP off with the real blocks and with an oracle
    drafter (accepted runs up to 5 drafts, rollback of the rest) through small pools; pools end at baseline."""
    model, cfg, _ = tiny
    k = 5
    calls: list[int] = []  # which block each draft step ran
    blocks = list(model.model.mtp.layers)
    for i, layer in enumerate(blocks):
        real_fwd = layer.forward

        def spy(*a, _i=i, _real=real_fwd, **kw):
            calls.append(_i)
            return _real(*a, **kw)
        monkeypatch.setattr(layer, "forward", spy)
    opts = dict(num_full_pages=96, num_swa_pages=40, max_num_batched_tokens=40, kv_arena=kv_arena)
    off = make_core(tiny, **opts)
    prompts = {f"p{i}": tokens(700 + i, n) for i, n in enumerate((5, 19, 33, 8))}
    want = run(off, prompts, 30)
    real_on = make_core(tiny, speculative_tokens=k, **opts)
    assert real_on._kv_mtp is not None and real_on._kv_mtp.num_layers("swa") == k
    calls.clear()
    assert run(real_on, prompts, 30) == want
    assert set(calls) == {0, 1, 2} and calls.count(2) > calls.count(1)  # block 2 runs for steps 2, 3 and 4
    if not kv_arena:  # (static pools: one tensor per layer)
        keys = [real_on._kv_mtp.layer_kv("swa", j)[0] for j in range(k)]
        for j in (3, 4):  # steps 3 and 4 wrote their own KV layers: written, not block 2's step-2 rows
            assert keys[j].abs().sum() > 0 and not torch.equal(keys[j], keys[j - 1])
    on = make_core(tiny, speculative_tokens=k, **opts)
    oracle(on, want, 0.9)
    assert run(on, prompts, 30) == want
    spec = on.spec_stats()
    assert spec is not None and len(spec.accept_hist) == k + 1 and spec.accept_hist[k] > 0  # 5 drafts accepted
    assert spec.accepted_len > 3.0, spec
    assert_baseline(on)
    assert_baseline(real_on)


def test_drafts_equal_a_one_pass_reference(tiny):
    """The blocks' KV kept across steps (provisional rows recomputed, the hidden ring) gives the drafts a
    one-pass run of the blocks over the final sequence gives, wherever the earlier drafts were right."""
    model, cfg, _ = tiny
    core = make_core(tiny, speculative_tokens=K, max_num_batched_tokens=16)
    seen: list[tuple[int, list[int]]] = []
    real = core._draft

    def record(plan):
        real(plan)
        s = core.scheduler.seqs.get("a")
        if s is not None and s.drafts:
            seen.append((len(s.token_ids), list(s.drafts)))
    core._draft = record  # type: ignore[method-assign]
    prompt = tokens(11, 37)
    out = run(core, {"a": prompt}, 30)["a"]
    seq = prompt + out
    n = len(seq)
    pages = -(-n // 4)
    table = [list(range(pages))]
    kv = KVPools.allocate(cfg, pages, pages, 4)
    ids = torch.tensor(seq)
    _, h = model(ids, BatchMeta.build([n], [n], table), kv, return_hidden=True)
    kv_mtp = KVPools.allocate_mtp(cfg, pages, 4)
    best = []
    prev = h[:n - 1]
    for j in range(K):
        m = n - 1 - j  # positions 0..n-2-j have their input token i+1+j
        logits, prev = model.forward_mtp(j, ids[1 + j:1 + j + m], prev[:m], BatchMeta.build([m], [m], table,
                                         all_logits=True), kv_mtp)
        best.append(logits.argmax(-1).tolist())
    checked = 0
    for length, drafts in seen:
        hi = length - 2
        for j, d in enumerate(drafts):
            if hi + 1 + j >= n or (j and drafts[j - 1] != seq[hi + j]):
                break  # past the end, or block j's input was a wrong draft: the reference does not apply
            if hi < len(best[j]):
                assert d == best[j][hi], (length, j)
                checked += 1
    assert checked >= 20


def test_drafting_pass_plans_attention_once_for_every_block(tiny, monkeypatch):
    """On one arena each block's KV layer sits in its own table row: the pass plans attention once and remaps
    it per row (before: one plan per block). The remapped contexts equal a plan built on each row's own page
    table, slot for slot (the drafts themselves are checked against a one-pass reference above)."""
    import libs.model.model as model_mod

    model, cfg, _ = tiny
    core = make_core(tiny, speculative_tokens=K, max_num_batched_tokens=16)  # kv_arena on (the default)
    kv = core._kv_mtp
    assert kv is not None and kv.arena is not None
    assert len({kv.layer_kv("swa", j)[2] for j in range(K)}) == K  # the case: a row per block
    core.add_request(Request("a", tokens(5, 21), greedy(24)))
    while core.has_work() and not core.scheduler.seqs["a"].is_decoding:
        core.step()
    plans: list[int] = []
    real_plan = model_mod.plan_paged_attention
    monkeypatch.setattr(model_mod, "plan_paged_attention", lambda *a, **kw: plans.append(1) or real_plan(*a, **kw))
    metas = []
    real_contexts = type(model).mtp_contexts

    def contexts(self, meta, kv_mtp, steps):
        metas.append(meta)
        return real_contexts(self, meta, kv_mtp, steps)
    monkeypatch.setattr(type(model), "mtp_contexts", contexts)
    real_draft, per_pass = core._draft, []

    def draft(plan):
        before = len(plans)
        real_draft(plan)
        per_pass.append(len(plans) - before)
    core._draft = draft  # type: ignore[method-assign]
    for _ in range(5):
        core.step()
    assert per_pass == [1] * 5 and core.scheduler.seqs["a"].drafts
    meta = metas[-1]
    shared = real_contexts(model, meta, kv, range(K))
    for j in range(K):
        row = kv.layer_kv("swa", j)[2]
        own = model_mod._context(meta, meta.swa_rows[row], kv.page_size, cfg.window_left, meta.positions,
                                 model._rope_swa, model.inv_freq_swa, model.dtype, swa=True)
        got = shared[row]
        assert torch.equal(got.slots, own.slots)
        assert len(got.plan.blocks) == len(own.plan.blocks)
        for a, b in zip(got.plan.blocks, own.plan.blocks, strict=True):
            assert torch.equal(a.slots, b.slots)


def test_block_inputs_use_drafts_past_the_verified_tokens():
    span = DraftSpan("r", lo=3, hi=5, tokens=list(range(10, 17)), swa_pages=[0, 1], kv_start=0, drafting=True)
    assert block_inputs(span, 0, []) == [14, 15, 16]
    assert block_inputs(span, 2, [90, 91]) == [16, 90, 91]
    prefill = DraftSpan("r", lo=0, hi=5, tokens=list(range(10, 17)), swa_pages=[0, 1], kv_start=0, drafting=False)
    assert prefill.block_end(2) == 3 and block_inputs(prefill, 2, []) == [13, 14, 15, 16]


def test_hidden_ring_keeps_the_newest_positions():
    ring = HiddenRing(2)
    lo, h = ring.span("r", 0, torch.arange(5.0)[:, None], floor=0)
    assert lo == 0 and h.shape[0] == 5
    lo, h = ring.span("r", 5, torch.tensor([[5.0]]), floor=0)
    assert lo == 3 and h.flatten().tolist() == [3.0, 4.0, 5.0]
    lo, h = ring.span("r", 9, torch.tensor([[9.0]]), floor=0)  # not contiguous: only the new rows
    assert lo == 9
    lo, h = ring.span("r", 10, torch.tensor([[10.0]]), floor=10)
    assert lo == 10 and h.flatten().tolist() == [10.0]


def test_worker_metrics_export_drafted_accepted_and_the_histogram(tiny):
    from prometheus_client import REGISTRY

    from libs.worker.metrics import export

    core = make_core(tiny, speculative_tokens=K)
    truth = run(make_core(tiny), {"a": tokens(5, 12), "b": tokens(6, 20)}, 12)
    oracle(core, truth, 1.0)
    run(core, {"a": tokens(5, 12), "b": tokens(6, 20)}, 12)
    load = core.load()
    assert load.spec is not None and len(load.spec.accept_hist) == K + 1
    export(load, {})
    get = REGISTRY.get_sample_value
    assert get("windserve_worker_spec_tokens", {"kind": "drafted"}) == load.spec.drafted_tokens > 0
    assert get("windserve_worker_spec_tokens", {"kind": "accepted"}) == load.spec.accepted_tokens > 0
    assert get("windserve_worker_spec_accept_length", {"tokens": str(K + 1)}) == load.spec.accept_hist[K] > 0
    assert make_core(tiny).load().spec is None


@pytest.mark.timeout(180)
async def test_disaggregated_mtp_ships_the_draft_kv_and_equals_colocated_greedy(tiny):
    """Prefill (MTP on) -> decode (MTP on) over the real transfer engine: greedy tokens equal a colocated engine
    without MTP, the hand-off carries the draft layers' SWA KV too (more bytes than with MTP off, by exactly
    their share), the decode worker verifies drafts, and both pools end at baseline."""
    from libs.engine import LLM, EngineConfig, SamplingParams
    from tests.test_disagg import OPTS, Pipeline, tokens_of, ucx_config
    from tests.test_disagg import prompt as dprompt

    model, cfg, _ = tiny
    prompts = [dprompt(1, 5), dprompt(2, 37), dprompt(3, 70)]
    expected = [list(o.token_ids) for o in LLM.from_core(EngineCore(EngineConfig(**OPTS), model, cfg, None)).generate(
        prompts, SamplingParams(max_tokens=12, ignore_eos=True))]
    sent = {}
    for k in (0, K):
        async with Pipeline(tiny, ucx_config(), speculative_tokens=k) as pipe:
            if k:
                oracle(pipe.decode_engine.core, {f"r{i}": e for i, e in enumerate(expected)}, 1.0)
            results = [await pipe.generate(f"r{i}", p, 12) for i, p in enumerate(prompts)]
            await pipe.assert_no_kv_in_use()
            sent[k] = pipe.prefill.stats.bytes_sent
            spec = pipe.decode_engine.core.spec_stats()
        assert [tokens_of(c) for c in results] == expected
    assert spec is not None and spec.accepted_tokens > 0
    k_page = make_core(tiny).runner.kv.layer_kv("swa", 0)[0][0]  # one SWA page of one layer's K (either layout)
    swa_layer_page = k_page.numel() * k_page.element_size() * 2  # K and V of one layer, one page
    extra = sent[K] - sent[0]
    n_swa = len(cfg.swa_layers)
    assert extra > 0 and extra % (K * swa_layer_page) == 0
    # the SWA share of the MTP-off shipment over its layers, times K layers, is the extra
    swa_pages_sent = extra // (K * swa_layer_page)
    assert swa_pages_sent * n_swa * swa_layer_page < sent[0]


def record_verified(core: EngineCore) -> dict[str, list[tuple[int, ...]]]:
    """The drafts each verify step of `core` checks, per request, in order."""
    seen: dict[str, list[tuple[int, ...]]] = {}
    real = core._sample

    def sample(plan, logits):
        for s in plan.seqs:
            if s.sample and s.num_draft:
                seen.setdefault(s.req_id, []).append(tuple(s.token_ids[-s.num_draft:]))
        return real(plan, logits)
    core._sample = sample  # type: ignore[method-assign]
    return seen


async def test_disaggregated_mtp_in_prefill_verifies_prefill_drafts_as_colocated(tiny):
    """MTP in prefill across the hand-off: kv_commit carries the prefill engine's drafts after the first token
    and its newest hidden states, so the decode engine's first step verifies k drafts and every verify step
    checks exactly the drafts a colocated engine checks (the real, untrained blocks: the drafts are theirs).
    Dropping the hidden rows changes later drafts; a sampled request's drafts stay on prefill. Pools end at
    baseline."""
    from libs.engine import EngineConfig
    from libs.worker import wire as worker_wire
    from tests.test_disagg import OPTS, Pipeline, tokens_of, ucx_config
    from tests.test_disagg import prompt as dprompt

    model, cfg, _ = tiny
    prompts = {"a": dprompt(1, 5), "b": dprompt(2, 37), "c": dprompt(3, 70)}
    colocated = EngineCore(EngineConfig(**OPTS, speculative_tokens=K), model, cfg, None)
    want = record_verified(colocated)
    expected = {rid: run(colocated, {rid: p}, 12)[rid] for rid, p in prompts.items()}  # one at a time, as below
    assert all(len(want[rid][0]) == K for rid in prompts)  # colocated: the first decode step verifies k drafts

    async def disaggregated(drop_hidden: bool) -> dict[str, list[tuple[int, ...]]]:
        async with Pipeline(tiny, ucx_config(), speculative_tokens=K) as pipe:
            got = record_verified(pipe.decode_engine.core)
            taken = []
            commit = pipe.decode.commit

            async def commit_seen(msg):
                assert len(msg.drafts) == K and msg.draft_hidden is not None and msg.draft_hidden.rows == K - 1
                if drop_hidden:
                    msg = msg.model_copy(update={"draft_hidden": None})
                taken.append(worker_wire.engine_first_drafts(msg))
                return await commit(msg)
            pipe.decode.commit = commit_seen  # type: ignore[method-assign]
            for rid, p in prompts.items():
                assert tokens_of(await pipe.generate(rid, p, 12)) == expected[rid]
            await pipe.assert_no_kv_in_use()
            assert len(taken) == len(prompts) and not pipe.prefill_engine.core._ring
        return got

    assert await disaggregated(drop_hidden=False) == want
    without = await disaggregated(drop_hidden=True)
    assert [without[rid][0] for rid in prompts] == [want[rid][0] for rid in prompts]  # the first drafts still
    assert without != want  # later drafts of blocks > 0 miss their rows at the prompt's last positions

    # a sampled request does not hand over drafts (their distributions stay on prefill)
    core = EngineCore(EngineConfig(**OPTS, speculative_tokens=K), model, cfg, None)
    core.add_request(Request("s", prompts["b"], SamplingParams(max_tokens=4, temperature=0.8, seed=1),
                             prefill_only=True))
    core.add_request(Request("g", prompts["c"], greedy(4), prefill_only=True))
    drain(core)
    assert core.first_drafts("s") is None
    first = core.first_drafts("g")
    assert first is not None and len(first.drafts) == K and first.hidden is not None
    assert first.hidden_from + first.hidden.shape[0] == len(prompts["c"])
    for rid in ("s", "g"):
        core.release(rid)
    assert_baseline(core)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_drafts_cross_the_wire_bit_exact(dtype):
    """kv_commit's drafts and hidden rows survive the JSON round trip bit for bit; rows that do not decode
    (bad base64, a byte count that does not divide into the rows) are no drafts, never an error."""
    from libs.engine.mtp import FirstDrafts
    from libs.worker.wire import engine_first_drafts, wire_hidden
    from protos.base import decode, encode
    from protos.messages import KVCommitRequest

    rows = torch.randn(2, 24, generator=torch.Generator().manual_seed(0)).to(dtype)
    first = FirstDrafts((5, 6, 7), 30, rows)
    msg = decode(encode(KVCommitRequest(request_id="r", first_token_id=1, drafts=list(first.drafts),
                                        draft_hidden=wire_hidden(first))), KVCommitRequest)
    back = engine_first_drafts(msg)
    assert back is not None and back.drafts == first.drafts and back.hidden_from == 30
    assert back.hidden is not None and back.hidden.dtype == dtype and torch.equal(back.hidden, rows)
    assert engine_first_drafts(msg.model_copy(update={"drafts": []})) is None
    h = msg.draft_hidden
    assert h is not None
    for bad in ("@@@@", h.data_b64[:-8]):
        assert engine_first_drafts(msg.model_copy(update={"draft_hidden": h.model_copy(
            update={"data_b64": bad, "rows": 7})})) is None


def test_decode_engine_drops_first_drafts_it_cannot_use(tiny):
    """activate() takes prefill's drafts only where they fit: a decode engine without MTP, a sampled request,
    more drafts than draft layers, ids outside the vocabulary, hidden rows of the wrong width, count or
    positions; a dropped hand-over decodes one token first, never fails."""
    from libs.engine import EngineConfig
    from libs.engine.disagg import DisaggEngineCore, RemoteRequest
    from libs.engine.mtp import FirstDrafts
    from tests.test_disagg import OPTS

    model, cfg, _ = tiny
    p = tokens(5, 20)
    good = torch.zeros(K - 1, cfg.hidden_size)
    cases = {
        "ok": (greedy(4), FirstDrafts((1, 2, 3), len(p) - (K - 1), good), True),
        "sampled": (SamplingParams(max_tokens=4, temperature=0.7), FirstDrafts((1, 2, 3), len(p) - 2, good), False),
        "too_many": (greedy(4), FirstDrafts((1, 2, 3, 4), len(p) - 2, good), False),
        "vocab": (greedy(4), FirstDrafts((1, cfg.vocab_size, 3), len(p) - 2, good), False),
        "width": (greedy(4), FirstDrafts((1, 2, 3), len(p) - 2, torch.zeros(2, cfg.hidden_size + 1)), False),
        "rows": (greedy(4), FirstDrafts((1, 2, 3), len(p) - 3, torch.zeros(K, cfg.hidden_size)), False),
        "where": (greedy(4), FirstDrafts((1, 2, 3), len(p) - 3, good), False),
    }
    for k in (K, 0):
        core = DisaggEngineCore(EngineConfig(**OPTS, speculative_tokens=k), model, cfg, None)
        for rid, (params, first, ok) in cases.items():
            core.add_request(RemoteRequest(rid, list(p), params))
            assert core.activate(rid, 7, None, first) is (ok and k > 0), rid
            assert core.scheduler.seqs[rid].drafts == (list(first.drafts) if ok and k else [])
        drain(core)
        assert_baseline(core)


# ------------------------------------------------------------------ temperature > 0: rejection sampling
CHI2_DF5_P001 = 20.515  # chi-square critical value, 5 degrees of freedom, significance 0.001


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampling_keeps_the_target_distribution():
    """On a 6-token vocabulary with a draft distribution far from the target's, the tokens speculation emits are
    distributed as the target's: the first (accepted draft or residual draw) as p0 and, when the first draft was
    accepted, the second as p1. Chi-square at significance 0.001, fixed seed, 20000 verify steps."""
    from libs.engine.mtp import rejection_accept

    g = torch.Generator().manual_seed(1234)
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04], [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
                      [1 / 6] * 6])
    q = torch.tensor([[0.05, 0.10, 0.10, 0.15, 0.20, 0.40], [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])
    first, second = torch.zeros(6), torch.zeros(6)
    n = 20000
    for _ in range(n):
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        acc, tok = rejection_accept(p, q, drafts, g)
        emitted = [*acc, tok]
        first[emitted[0]] += 1
        if acc:
            second[emitted[1]] += 1
    assert chi2(first, p[0]) < CHI2_DF5_P001, first / n
    assert second.sum() > 2000 and chi2(second, p[1]) < CHI2_DF5_P001, second / second.sum()
    # the check has power: the draft's own distribution is rejected
    assert chi2(first, q[0]) > 10 * CHI2_DF5_P001


def test_sampled_requests_speculate_and_stay_reproducible_per_seed(tiny):
    """temperature > 0 with MTP: drafts are verified by rejection sampling (some accepted), and a seeded
    request gives the same tokens in a second engine; pools at baseline."""
    from libs.engine import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=2.0, seed=7, ignore_eos=True)  # flat: random blocks overlap
    outs, stats = [], []
    for _ in range(2):
        core = make_core(tiny, speculative_tokens=K)
        for i in range(3):
            core.add_request(Request(f"s{i}", tokens(500 + i, 9 + 5 * i), params))
        outs.append(drain(core))
        stats.append(core.spec_stats())
        assert_baseline(core)
    assert outs[0] == outs[1]
    assert all(len(v) == 24 for v in outs[0].values())
    assert stats[0] is not None and stats[0].drafted_tokens > 0 and stats[0].accepted_tokens > 0


def test_penalties_and_logit_bias_draft_and_equal_mtp_off(tiny):
    """Greedy requests with presence / frequency / repetition penalties and logit bias draft too: each verified
    row is processed as if the drafts before it had been emitted one by one, so the outputs equal MTP off
    (oracle drafts, mostly right: accepted runs inside which the penalties change); pools at baseline."""
    from libs.engine import SamplingParams

    kinds = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0), dict(repetition_penalty=1.8),
             dict(logit_bias={7: 4.0, 9: -3.0}, frequency_penalty=0.7)]
    prompts = {f"k{k}p{i}": tokens(600 + i, 5 + 4 * i) for k in range(len(kinds)) for i in range(4)}
    params = {rid: SamplingParams(max_tokens=30, ignore_eos=True, **kinds[int(rid[1])])  # type: ignore[arg-type]
              for rid in prompts}

    def go(core: EngineCore) -> dict[str, list[int]]:
        for rid, p in prompts.items():
            core.add_request(Request(rid, p, params[rid]))
        return drain(core)
    want = go(make_core(tiny))
    plain = run(make_core(tiny), prompts, 30)
    for k in range(len(kinds)):  # every kind of processing changes some output: the comparison has power
        assert any(want[r] != plain[r] for r in prompts if r.startswith(f"k{k}")), kinds[k]
    on = make_core(tiny, speculative_tokens=K, max_num_seqs=16)
    oracle(on, want, 0.85)
    assert go(on) == want
    spec = on.spec_stats()
    assert spec is not None and spec.accepted_tokens > 0 and spec.accepted_len > 1.5, spec
    assert_baseline(on)


def drain_logprobs(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, list]]:
    """Like `drain`, also collecting each request's logprob entries (None for requests that ask for none)."""
    got: dict[str, list[int]] = {}
    lps: dict[str, list] = {}
    for _ in range(5000):
        if not core.has_work():
            return got, lps
        for out in core.step():
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
            entries = lps.setdefault(out.req_id, [])
            if out.logprobs is None:
                entries.extend([None] * len(out.new_token_ids))
            else:
                assert len(out.logprobs) == len(out.new_token_ids), out
                entries.extend(out.logprobs)
        core.check_invariants()
    raise AssertionError("engine did not drain")


@pytest.mark.parametrize("right", [None, 0.8])
def test_logprobs_requests_draft_and_equal_mtp_off(tiny, right):
    """Greedy requests with logprobs (top_logprobs 0, 1 and 5; one with a frequency penalty, whose logprobs are
    still the raw distribution's) draft, batched with requests without logprobs, different lengths (stops
    inside accepted runs): same tokens as MTP off, and every emitted token's logprob entry (its logprob, the
    top ids and their logprobs) equals MTP off's within 1e-5. right=None: the real (random) blocks draft;
    0.8: oracle drafts, so most entries come from accepted drafts' rows. Pools at baseline."""
    from libs.engine import SamplingParams

    kinds = [dict(logprobs=0), dict(logprobs=1), dict(logprobs=5), dict(logprobs=3, frequency_penalty=1.2),
             dict()]
    prompts = {f"k{k}p{i}": tokens(700 + 10 * k + i, 4 + 7 * i) for k in range(len(kinds)) for i in range(4)}
    params = {rid: SamplingParams(max_tokens=9 + 5 * int(rid[3]), ignore_eos=True,
                                  **kinds[int(rid[1])])  # type: ignore[arg-type]
              for rid in prompts}

    def go(core: EngineCore):
        for rid, p in prompts.items():
            core.add_request(Request(rid, p, params[rid]))
        return drain_logprobs(core)
    want, want_lp = go(make_core(tiny))
    on = make_core(tiny, speculative_tokens=K)
    if right is not None:
        oracle(on, want, right)
    verified: dict[str, int] = {}  # request -> drafts accepted in its verify steps
    real_sample = on._sample

    def sample(plan, logits):
        out, accepted = real_sample(plan, logits)
        for rid, acc in accepted.items():
            verified[rid] = verified.get(rid, 0) + len(acc)
        return out, accepted
    on._sample = sample  # type: ignore[method-assign]
    got, got_lp = go(on)
    assert got == want
    for rid in prompts:
        k = params[rid].logprobs
        assert len(got_lp[rid]) == len(want_lp[rid]) == len(want[rid])
        for n, (g, w, t) in enumerate(zip(got_lp[rid], want_lp[rid], want[rid], strict=True)):
            if k is None:
                assert g is None and w is None
                continue
            assert g.token_id == w.token_id == t, (rid, n)
            assert abs(g.logprob - w.logprob) < 1e-5, (rid, n, g, w)
            assert len(g.top) == len(w.top) == k, (rid, n)
            assert [i for i, _ in g.top] == [i for i, _ in w.top], (rid, n, g.top, w.top)
            assert max((abs(a - b) for (_, a), (_, b) in zip(g.top, w.top, strict=True)), default=0) < 1e-5
    # the logprobs requests themselves verified drafts (not only the ones without logprobs)
    assert all(rid in verified for rid in prompts), sorted(set(prompts) - set(verified))
    if right:
        assert all(verified[rid] > 0 for rid in prompts), verified
        spec = on.spec_stats()
        assert spec is not None and spec.accepted_len > 1.5, spec
    assert_baseline(on)


def test_structured_output_drafts_and_equals_mtp_off(tiny):
    """Requests under a JSON schema draft: each verified row is masked by the grammar after the drafts before
    it, a draft the grammar refuses ends acceptance, the matcher rolls back over rejected drafts. Greedy (with
    logprobs on some) and seeded sampled requests under the schema, batched with unconstrained ones, real
    (random) blocks and an oracle drafter (the MTP-off output, some tokens corrupted: refused and rejected
    drafts): greedy outputs and logprobs equal MTP off, every constrained output is valid JSON of the schema,
    the constrained requests accepted drafts; matchers released, pools at baseline."""
    import json

    import jsonschema

    from libs.engine import SamplingParams
    from libs.engine.request import GrammarSpec

    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 4}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]}, "tags": {"type": "array", "items": {"type": "boolean"},
                                                               "maxItems": 3}},
        "required": ["name", "age", "color", "tags"], "additionalProperties": False}
    spec = GrammarSpec("json_schema", json.dumps(schema))
    _, _, tok = tiny
    prompts = {f"g{i}": tokens(800 + i, 5 + 6 * i) for i in range(6)}
    prompts.update({f"u{i}": tokens(850 + i, 7 + 3 * i) for i in range(2)})
    params = {rid: SamplingParams(max_tokens=160, grammar=spec, logprobs=2 if int(rid[1]) % 2 else None)
              if rid[0] == "g" else SamplingParams(max_tokens=20, ignore_eos=True) for rid in prompts}
    sampled = {f"s{i}": SamplingParams(max_tokens=160, temperature=1.0, seed=30 + i, grammar=spec) for i in range(3)}

    def go(core: EngineCore, with_sampled: bool = False):
        for rid, p in prompts.items():
            core.add_request(Request(rid, p, params[rid]))
        if with_sampled:
            for i, (rid, p) in enumerate(sampled.items()):
                core.add_request(Request(rid, tokens(870 + i, 9), p))
        return drain_logprobs(core)

    def valid(out: dict[str, list[int]], rids) -> None:
        for rid in rids:
            text = tok.decode(out[rid], skip_special_tokens=True)
            jsonschema.validate(json.loads(text), schema)

    want, want_lp = go(make_core(tiny))
    valid(want, [r for r in prompts if r[0] == "g"])
    for right in (None, 0.8):
        on = make_core(tiny, speculative_tokens=K)
        if right is not None:
            oracle(on, want, right)
        verified: dict[str, int] = {}
        real_sample = on._sample

        def sample(plan, logits, real_sample=real_sample, verified=verified):
            out, accepted = real_sample(plan, logits)
            for rid, acc in accepted.items():
                verified[rid] = verified.get(rid, 0) + len(acc)
            return out, accepted
        on._sample = sample  # type: ignore[method-assign]
        got, got_lp = go(on, with_sampled=right is None)
        assert {r: got[r] for r in prompts} == want, right
        for rid in prompts:
            for g, w in zip(got_lp[rid], want_lp[rid], strict=True):
                assert (g is None) == (w is None)
                if g is not None:
                    assert g.token_id == w.token_id and abs(g.logprob - w.logprob) < 1e-5
                    assert [i for i, _ in g.top] == [i for i, _ in w.top]
        valid(got, [r for r in got if r[0] in "gs"])
        assert all(r in verified for r in prompts if r[0] == "g"), verified
        if right is not None:
            assert all(verified[r] > 0 for r in prompts if r[0] == "g"), verified
        assert len(on.grammars) == 0
        assert_baseline(on)


def test_grammar_verify_masks_rows_after_the_drafts_and_rolls_back_rejected_ones():
    """`GrammarBook.verify_bitmask`: row i is the mask of a fresh matcher fed the tokens so far and drafts[:i];
    the allowed count stops at the first draft the grammar refuses; `settle` leaves the matcher as one fed only
    the accepted drafts and the sampled token (same next mask); drafting's `feed_draft` / `unwind` likewise."""
    import json

    import xgrammar as xgr

    from libs.engine.grammar import ConstrainedRow, GrammarBook, GrammarCache
    from libs.engine.request import GrammarSpec
    from libs.model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                  "required": ["a"], "additionalProperties": False}))
    vocab = 512
    cache = GrammarCache(tok, vocab, tok.eos_token_ids)
    prompt = [5, 6, 7]
    out = list(b'{"a": ')

    def fresh_mask(fed: list[int]) -> torch.Tensor:
        m = xgr.GrammarMatcher(cache.compile(spec))
        for t in fed:
            assert m.accept_token(t)
        mask = xgr.allocate_token_bitmask(1, vocab)
        m.fill_next_token_bitmask(mask, 0)
        return mask[0]

    for drafts, allowed in ((list(b"12}"), 3), (list(b"1x3"), 1), (list(b"x12"), 0)):
        book = GrammarBook(cache)
        row = ConstrainedRow(0, "r", spec, prompt + out, len(prompt))
        mask, applied, n = book.verify_bitmask(row, drafts, "cpu")
        assert n == allowed, drafts
        assert applied == list(range(allowed + 1))
        for i in applied:
            assert torch.equal(mask[i], fresh_mask(out + drafts[:i])), (drafts, i)
        for acc in range(allowed + 1):  # any acceptance up to the allowed drafts, then a sampled token
            book = GrammarBook(cache)
            book.verify_bitmask(row, drafts, "cpu")
            # the target's token after them (one the grammar allows there): a digit, or the stop token once the
            # object is closed ("12}" accepted)
            nxt = tok.eos_token_ids[0] if acc == 3 else ord("4")
            book.settle("r", acc, nxt)
            done = out + drafts[:acc] + [nxt]
            assert book._matchers["r"].matcher.is_terminated() == (acc == 3)
            if acc == 3:
                continue
            assert torch.equal(book.bitmask([ConstrainedRow(0, "r", spec, prompt + done, len(prompt))], 1, "cpu")[0][0],
                               fresh_mask(done)), (drafts, acc)
    book = GrammarBook(cache)
    row = ConstrainedRow(0, "r", spec, prompt + out, len(prompt))
    book.bitmask([row], 1, "cpu")
    for t in b"12":
        book.feed_draft("r", t)
    assert torch.equal(book.bitmask([row], 1, "cpu")[0][0], fresh_mask(out + list(b"12")))
    book.unwind("r")
    assert torch.equal(book.bitmask([row], 1, "cpu")[0][0], fresh_mask(out))


def test_sampled_logprobs_with_mtp_equal_a_full_recompute(tiny):
    """Sampled requests (temperature > 0, rejection sampling) with logprobs draft and accept drafts; every
    emitted token's entry equals the raw distribution of a one-forward recompute over the prompt and the
    tokens before it (an independent reference; MTP off would sample other tokens)."""
    from libs.engine import SamplingParams
    from libs.engine.runner import one_shot_logits

    model, cfg, _ = tiny
    on = make_core(tiny, speculative_tokens=K)
    prompts = {f"s{i}": tokens(900 + i, 6 + 5 * i) for i in range(3)}
    for i, (rid, p) in enumerate(prompts.items()):
        on.add_request(Request(rid, p, SamplingParams(max_tokens=16, temperature=2.0, seed=40 + i, logprobs=3,
                                                      ignore_eos=True)))
    got, lps = drain_logprobs(on)
    spec = on.spec_stats()
    assert spec is not None and spec.accepted_tokens > 0, spec
    for rid, p in prompts.items():
        assert len(got[rid]) == 16
        for n, (t, e) in enumerate(zip(got[rid], lps[rid], strict=True)):
            ref = one_shot_logits(model, cfg, p + got[rid][:n]).float().log_softmax(dim=-1)
            assert e.token_id == t and abs(e.logprob - float(ref[t])) < 1e-5, (rid, n)
            vals, ids = ref.topk(3)
            assert [i for i, _ in e.top] == ids.tolist(), (rid, n)
            assert max(abs(a - float(b)) for (_, a), b in zip(e.top, vals, strict=True)) < 1e-5
    assert_baseline(on)


def test_forced_tool_calls_and_schemas_stay_valid_with_mtp():
    """Sampled constrained requests with MTP (structural-tag tool calls in both formats, JSON schemas, json
    objects): the engine-level checks of tests/test_tools.py and tests/test_structured.py hold on an engine that
    drafts, and the constrained requests accepted drafts."""
    from libs.engine import LLM
    from tests import test_structured as ts
    from tests import test_tools as tt

    torch.manual_seed(0)
    llm = LLM(None, speculative_tokens=K, **ts.ENGINE)
    tt.test_forced_calls_always_parse_and_validate_over_seeds_in_the_engine(llm)
    tt.test_forced_xml_calls_parse_and_validate_over_seeds_in_the_engine(llm)
    ts.test_json_schema_outputs_always_validate_over_many_seeds(llm)
    ts.test_json_object_outputs_parse_as_objects(llm)
    spec = llm.core.spec_stats()
    assert spec is not None and spec.accepted_tokens > 0, spec


def test_a_resumed_request_with_mtp_equals_mtp_off_uninterrupted(tiny):
    """#36: a stream migrated with the tokens it had sent (`Request.resumed`) onto an engine that drafts: the rest
    equals MTP off, uninterrupted (the oracle's drafts are mostly right, so runs of drafts are accepted)."""
    off = make_core(tiny, max_num_batched_tokens=24)
    on = make_core(tiny, max_num_batched_tokens=24, speculative_tokens=K)
    prompts = {f"m{i}": tokens(700 + i, n) for i, n in enumerate((9, 33, 58))}
    want = run(off, prompts, 30)
    oracle(on, {f"{rid}r": want[rid] for rid in prompts}, 0.9)  # (indexed by output position: resumed first)
    for rid, p in prompts.items():
        on.add_request(Request(f"{rid}r", p, greedy(30), resumed=want[rid][:7]))
    got = drain(on)
    assert {rid: want[rid][:7] + got[f"{rid}r"] for rid in prompts} == want
    assert on.scheduler.stats.accepted_tokens > 0
    assert_baseline(on)
