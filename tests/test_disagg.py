"""Disaggregated prefill -> decode in one process: real engines, real ucxx transfer on loopback.

References: the colocated engine (offline LLM, same pool layout) and full-recompute greedy decoding.
Byte counts are checked against an independent formula from the model's dimensions.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict

import pytest
import torch

from libs.engine import LLM, AsyncEngine, EngineConfig, EngineCore, SamplingParams
from libs.engine import disagg as dg
from libs.engine.runner import direct_greedy
from libs.model import load_model, load_tokenizer
from libs.transfer import TransferBackend, TransferConfig, create_engine
from protos import subjects
from protos.messages import GenerateRequest, TokenChunk, WireFinishReason, WireSamplingParams
from services.decode.handlers import DecodeWorker
from services.prefill.handlers import PrefillWorker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PAGE = 4
OPTS = dict(page_size=PAGE, num_full_pages=256, num_swa_pages=96, max_num_batched_tokens=64, bucket_edges=(),
            max_num_seqs=16)
TCP_LO = (("TLS", "tcp,self"), ("NET_DEVICES", "lo"))
BOUND_S = 5.0


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, cfg = load_model(None)
    return model, cfg, load_tokenizer(None)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=g).tolist()


class Stream:
    """Collects TokenChunks per stream subject (stands in for the gateway)."""

    def __init__(self) -> None:
        self.chunks: dict[str, list[TokenChunk]] = defaultdict(list)
        self.final: dict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def publish(self, subject: str, chunk: TokenChunk) -> None:
        self.chunks[subject].append(chunk)
        if chunk.finish_reason is not None:
            self.final[subject].set()

    async def result(self, request_id: str, timeout: float = 60) -> list[TokenChunk]:
        subject = subjects.stream("t", request_id)
        await asyncio.wait_for(self.final[subject].wait(), timeout)
        return self.chunks[subject]


class Pipeline:
    def __init__(self, tiny, transfer_config: TransferConfig, **overrides) -> None:
        model, cfg, tok = tiny
        config = EngineConfig(**{**OPTS, **overrides})
        self.prefill_engine = AsyncEngine(EngineCore(config, model, cfg, tok), output_timeout_s=60)
        self.decode_engine = AsyncEngine(dg.DisaggEngineCore(config, model, cfg, tok), output_timeout_s=60)
        self.tx = create_engine(transfer_config, TransferBackend.UCX)
        self.rx = create_engine(transfer_config, TransferBackend.UCX)
        self.stream = Stream()

    async def __aenter__(self) -> Pipeline:
        self.prefill_engine.start()
        self.decode_engine.start()
        await self.tx.start()
        await self.rx.start()
        self.decode = DecodeWorker(self.decode_engine, self.rx, "d0", self.stream.publish, transfer_timeout_s=30)
        self.prefill = PrefillWorker(self.prefill_engine, self.tx, "p0", self._prepare, self.stream.publish,
                                     commit=self._commit, transfer_timeout_s=30)
        return self

    async def _prepare(self, decode_instance: str, msg):
        assert decode_instance == "d0"
        return await self.decode.prepare(msg)

    async def _commit(self, decode_instance: str, msg):
        assert decode_instance == "d0"
        return await self.decode.commit(msg)

    async def __aexit__(self, *exc) -> None:
        await self.tx.close()
        await self.rx.close()
        await asyncio.to_thread(self.prefill_engine.shutdown)
        await asyncio.to_thread(self.decode_engine.shutdown)

    async def generate(self, request_id: str, tokens: list[int], max_tokens: int) -> list[TokenChunk]:
        req = GenerateRequest(request_id=request_id, token_ids=tokens, stream_subject=subjects.stream("t", request_id),
                              sampling=WireSamplingParams(max_tokens=max_tokens, temperature=0.0), decode_instance="d0")
        return await self.run(req)

    async def run(self, req: GenerateRequest) -> list[TokenChunk]:
        await self.prefill.submit(req)
        return await self.stream.result(req.request_id)

    async def assert_no_kv_in_use(self) -> None:
        for engine in (self.prefill_engine, self.decode_engine):
            usage = await engine.call(lambda core: (core.check_invariants(), core.usage())[1])
            for pool in (usage.full, usage.swa):
                assert pool.in_use == 0 and pool.reserved == 0, f"pages still held: {pool}"
        assert not self.decode_engine.core.pending


def tokens_of(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def ucx_config(**kw) -> TransferConfig:
    return TransferConfig(ucx_options=TCP_LO, register_grace_s=0.2, drain_timeout_s=1.0, **kw)


# ------------------------------------------------------------------------------------------ pure plan
@pytest.mark.unit
@pytest.mark.parametrize("n,hit,full,swa", [
    (5, 0, [0, 1], [0, 1]),                      # shorter than the window: everything
    (37, 0, list(range(10)), [5, 6, 7, 8, 9]),  # 16-token window = 4 pages + the page being filled
    (40, 0, list(range(10)), [6, 7, 8, 9]),     # page-aligned end: exactly the window
    (37, 32, [8, 9], [8, 9]),                   # decode holds a prefix: only what follows it
    (37, 8, list(range(2, 10)), [5, 6, 7, 8, 9]),
])
def test_plan_ships_missing_full_pages_and_the_last_window(n, hit, full, swa):
    plan = dg.plan_shipment(n, PAGE, 16, hit)
    assert list(plan.full_pages) == full and list(plan.swa_pages) == swa


@pytest.mark.unit
def test_plan_rejects_unaligned_or_oversized_hits():
    with pytest.raises(ValueError, match="page aligned"):
        dg.plan_shipment(37, PAGE, 16, 6)
    with pytest.raises(ValueError, match="page aligned"):
        dg.plan_shipment(8, PAGE, 16, 8)


# ------------------------------------------------------------------------------------------ end to end
async def test_greedy_tokens_equal_colocated_engine_including_long_prompts(tiny):
    model, cfg, _ = tiny
    prompts = [prompt(1, 5), prompt(2, 37), prompt(3, 70), prompt(4, 16), prompt(5, 53)]  # window is 16 tokens
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    expected = [list(o.token_ids) for o in LLM.from_core(
        EngineCore(EngineConfig(**OPTS), model, cfg, None)).generate(prompts, params)]
    async with Pipeline(tiny, ucx_config()) as pipe:
        results = await asyncio.gather(*(pipe.generate(f"r{i}", p, 10) for i, p in enumerate(prompts)))
        await pipe.assert_no_kv_in_use()
    for chunks, want in zip(results, expected, strict=True):
        assert tokens_of(chunks) == want
        assert chunks[-1].finish_reason is WireFinishReason.LENGTH
        assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens > 0
    assert tokens_of(results[2]) == direct_greedy(model, cfg, prompts[2], 10, page_size=PAGE)


@pytest.mark.parametrize("seed", [None, 9])
async def test_a_resumed_stream_equals_the_colocated_uninterrupted_one(tiny, seed):
    """#36: a stream migrated off a failed worker, sent with the tokens it already produced (resume_token_ids):
    prefill computes them with the prompt, decode takes them as output; the rest equals the colocated engine's
    run (greedy, and seeded sampling: each draw depends on (seed, position)), usage counts the whole answer."""
    model, cfg, _ = tiny
    p, n, cut = prompt(11, 37), 24, 9
    temp = 0.0 if seed is None else 1.0
    want = list(LLM.from_core(EngineCore(EngineConfig(**OPTS), model, cfg, None)).generate(
        [p], SamplingParams(max_tokens=n, ignore_eos=True, temperature=temp, seed=seed))[0].token_ids)
    async with Pipeline(tiny, ucx_config()) as pipe:
        sampling = WireSamplingParams(max_tokens=n, temperature=temp, seed=seed, ignore_eos=True)
        whole = tokens_of(await pipe.run(GenerateRequest(request_id="w", token_ids=p, stream_subject=subjects.stream(
            "t", "w"), sampling=sampling, decode_instance="d0")))
        chunks = await pipe.run(GenerateRequest(request_id="m", token_ids=p, stream_subject=subjects.stream("t", "m"),
                                                sampling=sampling, decode_instance="d0", resume_token_ids=want[:cut]))
        await pipe.assert_no_kv_in_use()
    assert whole == want and tokens_of(chunks) == want[cut:]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(p), n)


async def test_bytes_moved_are_full_pages_plus_swa_window_only(tiny):
    _, cfg, _ = tiny
    n = 70
    async with Pipeline(tiny, ucx_config()) as pipe:
        await pipe.generate("bytes", prompt(7, n), 3)
        sent, received = pipe.prefill.stats.bytes_sent, pipe.decode.stats.bytes_received
        full_equiv = pipe.prefill.stats.full_equivalent_bytes
    # Independent formula: float32 K (qk dim) + V (v dim) per KV head per token, per layer.
    full_tok = cfg.kv_heads_full * (cfg.qk_head_dim + cfg.v_head_dim) * 4
    swa_tok = cfg.kv_heads_swa * (cfg.qk_head_dim + cfg.v_head_dim) * 4
    pages = -(-n // PAGE)  # 18
    window_pages = pages - (n // PAGE - -(-cfg.sliding_window // PAGE))  # pages 13..17 = 5
    expected = (len(cfg.full_layers) * pages * PAGE * full_tok
                + len(cfg.swa_layers) * window_pages * PAGE * swa_tok)
    assert window_pages == 5
    assert sent == received == expected
    assert full_equiv == (len(cfg.full_layers) * full_tok + len(cfg.swa_layers) * swa_tok) * pages * PAGE
    assert sent < full_equiv


async def test_follow_up_turn_hits_on_decode_and_ships_less(tiny):
    model, cfg, _ = tiny
    first = prompt(11, 45)
    async with Pipeline(tiny, ucx_config()) as pipe:
        out1 = tokens_of(await pipe.generate("turn1", first, 8))
        bytes1 = pipe.prefill.stats.bytes_sent
        second = first + out1 + prompt(12, 9)
        out2 = tokens_of(await pipe.generate("turn2", second, 8))
        bytes2 = pipe.prefill.stats.bytes_sent - bytes1
        assert pipe.decode.stats.hit_tokens > 0  # the finished first turn was cached on decode
        await pipe.assert_no_kv_in_use()
    assert out2 == direct_greedy(model, cfg, second, 8, page_size=PAGE)
    assert bytes2 < bytes1  # longer prompt, fewer bytes: only pages after the decode-side hit travel


async def test_decode_keeps_no_checkpoint_over_swa_pages_prefill_never_shipped(tiny):
    """Prefill ships a prompt's SWA KV for its last window only; a decode-side checkpoint reaching below it
    (a page-aligned prompt's PROMPT_END, a migrated stream's earlier ends) would cache pages never written.
    The decode pools start as noise, so such a page read by a later hit changes the tokens: a request sharing
    the first 36 of a 40-token prompt must equal full recompute."""
    model, cfg, _ = tiny
    first = prompt(40, 40)  # page-aligned: its last window is pages 6..9; PROMPT_END (36) needs page 5 too
    second = first[:36] + prompt(41, 1)
    async with Pipeline(tiny, ucx_config()) as pipe:
        kv = pipe.decode_engine.core.runner.kv
        for t in (kv.arena.k, kv.arena.v) if kv.arena is not None else (kv.swa_k, kv.swa_v, kv.full_k, kv.full_v):
            t.normal_(0, 30.0)
        await pipe.generate("first", first, 4)
        out = tokens_of(await pipe.generate("second", second, 6))
        await pipe.assert_no_kv_in_use()
    assert out == direct_greedy(model, cfg, second, 6, page_size=PAGE)


async def test_branch_far_past_a_checkpoint_rebuilds_on_prefill_not_on_decode(tiny):
    """Both sides cache a long prompt; a request branching deep inside it (no checkpoint there) gets a window
    rebuild on prefill, while decode takes only a valid hit (the KV it receives lands in its own pages, never
    in shared tree pages); the output equals full recompute."""
    model, cfg, _ = tiny
    stem = prompt(30, 240)
    async with Pipeline(tiny, ucx_config()) as pipe:
        await pipe.generate("a", stem + prompt(31, 9), 4)
        branch = stem[:200] + prompt(32, 7)
        out = tokens_of(await pipe.generate("b", branch, 6))
        assert pipe.prefill_engine.core.cache.rebuild_stats().admitted == 1
        assert pipe.decode_engine.core.cache.rebuild_stats().matched == 0
        await pipe.assert_no_kv_in_use()
    assert out == direct_greedy(model, cfg, branch, 6, page_size=PAGE)


class FailingTransfer:
    """Wraps a real engine; the outgoing transfer dies after `after` layers (sender crash mid-stream)."""

    def __init__(self, engine, after: int) -> None:
        self.engine, self.after = engine, after

    async def begin_send(self, address, request_id, specs):
        tx = await self.engine.begin_send(address, request_id, specs)
        after, real_send = self.after, tx.send_layer
        sent = 0

        async def send_layer(payload):
            nonlocal sent
            if sent == after:
                raise OSError("simulated prefill failure mid-transfer")
            sent += 1
            await real_send(payload)

        tx.send_layer = send_layer
        return tx


async def test_failure_mid_transfer_reaches_client_and_frees_kv_on_both_sides(tiny):
    async with Pipeline(tiny, ucx_config(layer_timeout_s=30, header_timeout_s=30)) as pipe:
        pipe.prefill.transfer = FailingTransfer(pipe.tx, after=2)
        loop = asyncio.get_running_loop()
        start = loop.time()
        chunks = await pipe.generate("dies", prompt(21, 60), 8)
        took = loop.time() - start
        errors = [c for c in chunks if c.finish_reason is WireFinishReason.ERROR]
        assert errors and "mid-transfer" in errors[0].error
        assert took < BOUND_S  # signalled explicitly, far below the 30 s transfer timeouts
        await asyncio.sleep(0.2)  # the decode side's cleanup runs after its error chunk
        await pipe.assert_no_kv_in_use()
        # both sides still serve correctly afterwards
        pipe.prefill.transfer = pipe.tx
        ok = await pipe.generate("after", prompt(22, 30), 4)
        assert ok[-1].finish_reason is WireFinishReason.LENGTH


async def test_decode_engine_full_is_refused_and_prefill_frees(tiny):
    async with Pipeline(tiny, ucx_config(), max_num_seqs=1) as pipe:
        pipe.decode_engine.core.pending["squatter"] = object()  # type: ignore[assignment]  # occupies the slot
        chunks = await pipe.generate("refused", prompt(31, 20), 4)
        assert chunks[-1].finish_reason is WireFinishReason.ERROR and "full" in chunks[-1].error
        pipe.decode_engine.core.pending.clear()
        await pipe.assert_no_kv_in_use()


async def test_abort_right_after_prefill_frees_the_held_kv(tiny, monkeypatch):
    """The client leaves while the prefill worker asks the engine about the first token (the prompt's KV is
    held by then): the request ends with an abort and the held KV is released, not leaked."""
    async with Pipeline(tiny, ucx_config()) as pipe:
        loop = asyncio.get_running_loop()
        reached, go = asyncio.Event(), threading.Event()
        check = dg.first_token_finishes

        def gated(core, params, token, resumed=()):  # runs on the engine thread
            loop.call_soon_threadsafe(reached.set)
            go.wait(10)
            return check(core, params, token, resumed)

        monkeypatch.setattr(dg, "first_token_finishes", gated)
        req = GenerateRequest(request_id="gone", token_ids=prompt(41, 40), stream_subject=subjects.stream("t", "gone"),
                              sampling=WireSamplingParams(max_tokens=4, temperature=0.0), decode_instance="d0")
        pipe.prefill.submit(req)
        await asyncio.wait_for(reached.wait(), 30)
        abort = asyncio.ensure_future(pipe.prefill.abort("gone"))
        await asyncio.sleep(0.05)  # the cancel lands while the engine call is in flight
        go.set()
        assert await asyncio.wait_for(abort, 10)
        chunks = await pipe.stream.result("gone")
        assert chunks[-1].finish_reason is WireFinishReason.ABORT
        await pipe.assert_no_kv_in_use()


# ----------------------------------------------------------------------------- streaming while prefill computes
@pytest.mark.unit
@pytest.mark.parametrize("n,hit,seg", [(37, 8, 4), (37, 0, 4), (40, 0, 4), (5, 0, 4), (200, 64, 3), (64, 0, 16),
                                       (37, 32, 2), (37, 0, 0), (1000, 12, 1)])
def test_stream_plan_segments_concatenate_to_the_shipment(n, hit, seg):
    plan = dg.plan_stream(n, PAGE, 16, hit, seg)
    ship = dg.plan_shipment(n, PAGE, 16, hit)
    assert plan.ship == ship
    assert tuple(p for s in plan.segments for p in s.full_pages) == ship.full_pages
    *middle, last = plan.segments
    assert last.swa_pages == ship.swa_pages and last.ready_tokens == n  # SWA pages only with the final window
    for s in middle:
        assert not s.swa_pages and s.full_pages
        assert s.ready_tokens == (s.full_pages[-1] + 1) * PAGE < n  # complete pages, final before the prompt ends
        assert seg and len(s.full_pages) <= seg and (s.full_pages[-1] + 1) % seg == 0  # cut at multiples of seg
    assert [s.ready_tokens for s in plan.segments] == sorted({s.ready_tokens for s in plan.segments})
    if seg == 0:
        assert len(plan.segments) == 1


@pytest.mark.unit
def test_stream_plan_of_the_docstring_example():
    plan = dg.plan_stream(37, PAGE, 16, 8, 4)
    assert [(s.full_pages, s.swa_pages, s.ready_tokens) for s in plan.segments] == [
        ((2, 3), (), 16), ((4, 5, 6, 7), (), 32), ((8, 9), (5, 6, 7, 8, 9), 37)]
    with pytest.raises(ValueError, match="segment_pages"):
        dg.plan_stream(37, PAGE, 16, 8, -1)


def test_engine_reports_prefill_progress_after_each_committed_step(tiny):
    model, cfg, tok = tiny
    core = EngineCore(EngineConfig(**OPTS), model, cfg, tok)
    seen: list[tuple[int, int, str]] = []

    def hook(p) -> None:  # engine thread; the pages it names hold the KV of [0, num_computed)
        seq = core.scheduler.seqs["pf"]
        seen.append((p.num_computed, len(p.full_pages), seq.status.value))

    from libs.engine import Request
    core.add_request(Request("pf", prompt(51, 150), SamplingParams(max_tokens=4), prefill_only=True, on_progress=hook))
    while core.has_work():
        core.step()
    assert [s[0] for s in seen] == [64, 128, 150]  # one call per chunk (max_num_batched_tokens 64)
    assert [s[2] for s in seen] == ["running", "running", "held"]
    assert all(pages >= -(-computed // PAGE) for computed, pages, _ in seen)
    core.release("pf")
    core.close()


class GatedCollector(dg.SegmentCollector):
    """Holds the engine thread after the first segment was copied out until `go` is set (or 10 s), so a test
    can act while the prefill provably has more to compute."""

    first_copied = threading.Event()
    go = threading.Event()

    def __call__(self, progress) -> None:
        before = self.next
        super().__call__(progress)
        if before == 0 and self.next > 0:
            GatedCollector.first_copied.set()
            GatedCollector.go.wait(10)


class ObservedTransfer:
    """Wraps a real engine; calls `on_first_layer()` when the first layer payload is about to be sent."""

    def __init__(self, engine, on_first_layer) -> None:
        self.engine, self.on_first_layer, self.layers = engine, on_first_layer, 0

    async def begin_send(self, address, request_id, specs):
        tx = await self.engine.begin_send(address, request_id, specs)
        real_send = tx.send_layer

        async def send_layer(payload):
            self.layers += 1
            if self.layers == 1:
                await self.on_first_layer()
            await real_send(payload)

        tx.send_layer = send_layer
        return tx


@pytest.fixture
def gated(monkeypatch):
    GatedCollector.first_copied.clear()
    GatedCollector.go.clear()
    monkeypatch.setattr(dg, "SegmentCollector", GatedCollector)
    yield GatedCollector
    GatedCollector.go.set()


async def test_first_segment_leaves_while_the_prefill_still_computes(tiny, gated):
    """The drift test of the streaming change: the first layer payload is sent while the engine (held after
    its first chunk) has most of the prompt left to compute; the output still equals the colocated engine."""
    model, cfg, _ = tiny
    p = prompt(61, 300)  # 5 chunks of 64 tokens; segments of 16 pages = one chunk
    computed_at_first_send: list[int] = []
    async with Pipeline(tiny, ucx_config()) as pipe:
        async def on_first_layer():
            # the engine thread hands the copies over just before it sets the event: allow it that moment
            assert gated.first_copied.wait(5)
            seq = pipe.prefill_engine.core.scheduler.seqs["early"]  # engine thread parked in the hook
            computed_at_first_send.append(seq.num_computed)
            gated.go.set()

        pipe.prefill.transfer = ObservedTransfer(pipe.tx, on_first_layer)
        chunks = await pipe.generate("early", p, 6)
        await pipe.assert_no_kv_in_use()
    assert computed_at_first_send == [64]
    assert tokens_of(chunks) == direct_greedy(model, cfg, p, 6, page_size=PAGE)


async def test_abort_mid_stream_frees_every_page_on_both_sides(tiny, gated):
    async with Pipeline(tiny, ucx_config()) as pipe:
        aborts: list[asyncio.Future] = []

        async def on_first_layer():  # the engine is parked after chunk 1 of 5, the stream is open
            aborts.append(asyncio.ensure_future(pipe.prefill.abort("midway")))
            try:
                await asyncio.sleep(0.05)  # the abort cancels this very send
            finally:
                gated.go.set()

        pipe.prefill.transfer = ObservedTransfer(pipe.tx, on_first_layer)
        req = GenerateRequest(request_id="midway", token_ids=prompt(62, 300), decode_instance="d0",
                              stream_subject=subjects.stream("t", "midway"),
                              sampling=WireSamplingParams(max_tokens=4, temperature=0.0))
        pipe.prefill.submit(req)
        chunks = await pipe.stream.result("midway")
        assert await asyncio.wait_for(aborts[0], 10)
        await asyncio.sleep(0.3)  # anything decode would still publish
        assert [c.finish_reason for c in chunks] == [WireFinishReason.ABORT]
        assert pipe.decode.stats.cancelled == 1 and not pipe.decode.tasks
        await pipe.assert_no_kv_in_use()
        ok = await pipe.generate("next", prompt(63, 90), 3)  # both sides serve on
        assert ok[-1].finish_reason is WireFinishReason.LENGTH


async def test_first_token_ending_the_request_cancels_the_open_decode_reservation(tiny):
    """max_tokens=1 (or EOS) is known only after the prefill, when decode already holds a reservation and part
    of the KV: prefill publishes the one-token answer itself, decode frees everything and publishes nothing."""
    model, cfg, _ = tiny
    p = prompt(64, 200)
    async with Pipeline(tiny, ucx_config()) as pipe:
        chunks = await pipe.generate("one", p, 1)
        await asyncio.sleep(0.3)
        assert len(chunks) == 1 and chunks[0].finish_reason is WireFinishReason.LENGTH
        assert chunks[0].instance_id == "p0" and chunks[0].usage.completion_tokens == 1
        assert pipe.decode.stats.cancelled == 1 and pipe.decode.stats.requests == 0
        await pipe.assert_no_kv_in_use()
    assert tokens_of(chunks) == direct_greedy(model, cfg, p, 1, page_size=PAGE)


async def test_full_decode_is_rerouted_before_any_prefill_compute(tiny):
    from libs.bus import RemoteError
    from protos.messages import ErrorCode

    model, cfg, _ = tiny
    p = prompt(65, 120)
    steps_at_refusal: list[int] = []
    async with Pipeline(tiny, ucx_config()) as pipe:
        core = pipe.prefill_engine.core

        async def prepare(decode_instance, msg):
            if decode_instance == "d-full":
                steps_at_refusal.append(core.num_steps)
                raise RemoteError("kv_prepare", ErrorCode.UNAVAILABLE, "decode engine is full")
            return await pipe.decode.prepare(msg)

        async def reroute(request_id, token_ids, refused):
            assert refused == ["d-full"]
            return "d0"

        pipe.prefill.prepare, pipe.prefill.reroute = prepare, reroute
        steps_before = core.num_steps
        req = GenerateRequest(request_id="moved", token_ids=p, decode_instance="d-full",
                              stream_subject=subjects.stream("t", "moved"),
                              sampling=WireSamplingParams(max_tokens=6, temperature=0.0))
        pipe.prefill.submit(req)
        chunks = await pipe.stream.result("moved")
        assert steps_at_refusal == [steps_before]  # refused before the prompt entered the engine
        assert pipe.prefill.stats.rerouted == 1 and core.scheduler.stats.admitted == 1
        await pipe.assert_no_kv_in_use()
    assert tokens_of(chunks) == direct_greedy(model, cfg, p, 6, page_size=PAGE)


async def test_many_segment_prompts_with_prefix_hits_on_either_side_equal_colocated(tiny):
    """Prompts several SWA windows long (window 16 tokens = 4 pages) in 2- and 3-page segments, with no hit,
    a prefill-side hit, a decode-side hit and both; greedy tokens equal the colocated engine and both engines'
    pools are back at baseline."""
    from libs.engine import Request

    model, cfg, tok = tiny
    stems = {name: prompt(70 + i, 96) for i, name in enumerate(["none", "prefill", "decode", "both"])}
    prompts = {name: stem + prompt(80 + i, 61 + 17 * i) for i, (name, stem) in enumerate(stems.items())}
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    names = list(prompts)
    expected = dict(zip(names, (list(o.token_ids) for o in LLM.from_core(
        EngineCore(EngineConfig(**OPTS), model, cfg, tok)).generate([prompts[n] for n in names], params)),
        strict=True))

    async def warm(engine: AsyncEngine, rid: str, tokens: list[int]) -> None:
        async for _ in engine.generate(Request(rid, tokens, SamplingParams(max_tokens=1))):
            pass

    async with Pipeline(tiny, ucx_config()) as pipe:
        await warm(pipe.prefill_engine, "w-p", stems["prefill"])
        await warm(pipe.decode_engine, "w-d", stems["decode"])
        await warm(pipe.prefill_engine, "w-bp", stems["both"])
        await warm(pipe.decode_engine, "w-bd", stems["both"])
        got, cached, hits = {}, {}, {}
        for seg, name in zip([2, 3, 2, 3], names, strict=True):
            pipe.prefill.segment_pages = seg
            before = pipe.decode.stats.hit_tokens
            chunks = await pipe.generate(name, prompts[name], 8)
            got[name], cached[name] = tokens_of(chunks), chunks[-1].usage.cached_tokens
            hits[name] = pipe.decode.stats.hit_tokens - before
        await pipe.assert_no_kv_in_use()
    assert got == expected
    assert cached["none"] == cached["decode"] == 0 and cached["prefill"] > 0 and cached["both"] > 0
    assert hits["none"] == hits["prefill"] == 0 and hits["decode"] > 0 and hits["both"] > 0


@pytest.mark.unit
def test_the_engine_side_of_the_hand_off_imports_neither_protos_nor_the_transfer_engine():
    import subprocess
    import sys

    code = ("import sys, libs.engine.disagg, libs.engine.core, libs.engine.async_engine; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'protos' or m.startswith('libs.transfer')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


async def test_gone_decode_is_rerouted_before_any_prefill_compute(tiny):
    """The routed decode worker is dead but still listed (kv_prepare: no responders): prefill asks the router for
    another one instead of failing the request (it used to end with 'no service is listening on kv_prepare')."""
    from libs.bus import NoResponders

    async with Pipeline(tiny, ucx_config()) as pipe:
        async def prepare(decode_instance, msg):
            if decode_instance == "d-dead":
                raise NoResponders("no service is listening on kv_prepare")
            return await pipe.decode.prepare(msg)

        async def reroute(request_id, token_ids, refused):
            assert refused == ["d-dead"]
            return "d0"

        pipe.prefill.prepare, pipe.prefill.reroute = prepare, reroute
        req = GenerateRequest(request_id="moved", token_ids=prompt(66, 30), decode_instance="d-dead",
                              stream_subject=subjects.stream("t", "moved"),
                              sampling=WireSamplingParams(max_tokens=4, temperature=0.0))
        pipe.prefill.submit(req)
        chunks = await pipe.stream.result("moved")
        assert chunks[-1].finish_reason is WireFinishReason.LENGTH and pipe.prefill.stats.rerouted == 1
        await pipe.assert_no_kv_in_use()


async def test_only_decode_with_no_responders_is_asked_again_within_the_grace(tiny):
    """The only decode worker has no responders for a moment (its NATS client moving to another node of the
    cluster) and the router finds no other: kv_prepare is asked again until it answers, within
    unreachable_grace_s; one that never answers fails the request once the grace is spent. kv_commit too."""
    import time

    from libs.bus import NoResponders

    async with Pipeline(tiny, ucx_config()) as pipe:
        back_at = time.monotonic() + 0.4

        async def prepare(decode_instance, msg):
            if decode_instance == "d-dead" or time.monotonic() < back_at:
                raise NoResponders("no service is listening on kv_prepare")
            return await pipe.decode.prepare(msg)

        async def reroute(request_id, token_ids, refused):
            raise LookupError(f"the router offered no decode worker besides {refused}")

        pipe.prefill.prepare, pipe.prefill.reroute = prepare, reroute
        pipe.prefill.unreachable_grace_s = 1.5
        sampling = WireSamplingParams(max_tokens=4, temperature=0.0)
        req = GenerateRequest(request_id="moving", token_ids=prompt(68, 30), decode_instance="d0",
                              stream_subject=subjects.stream("t", "moving"), sampling=sampling)
        pipe.prefill.submit(req)
        chunks = await pipe.stream.result("moving")
        assert chunks[-1].finish_reason is WireFinishReason.LENGTH and pipe.prefill.stats.reasked >= 2

        started = time.monotonic()
        req = GenerateRequest(request_id="gone", token_ids=prompt(69, 30), decode_instance="d-dead",
                              stream_subject=subjects.stream("t", "gone"), sampling=sampling)
        pipe.prefill.submit(req)
        chunks = await pipe.stream.result("gone")
        assert chunks[-1].error and "gone (no responders)" in chunks[-1].error
        assert 1.4 < time.monotonic() - started < 10

        # kv_commit meeting no responders for a moment (after the prefill): asked again, the request is served
        back_at = time.monotonic() + 0.4
        reasked = pipe.prefill.stats.reasked

        async def commit(decode_instance, msg):
            if time.monotonic() < back_at:
                raise NoResponders("no service is listening on kv_commit")
            return await pipe.decode.commit(msg)

        pipe.prefill.commit = commit
        chunks = await pipe.generate("commit", prompt(70, 30), 4)
        assert chunks[-1].finish_reason is WireFinishReason.LENGTH and pipe.prefill.stats.reasked > reasked
        await pipe.assert_no_kv_in_use()


async def test_full_decode_makes_the_request_wait_for_room_then_bounded_503(tiny):
    """Every decode worker full: the request waits (before any compute) and runs once room frees; a request that
    waits past decode_wait_s gets the retryable error (the client's 503 + Retry-After)."""
    async with Pipeline(tiny, ucx_config(), max_num_seqs=1) as pipe:
        pipe.prefill.decode_wait_s = 20.0

        async def reroute(request_id, token_ids, refused):
            return "d0"  # the router's pick: the one (full) decode worker

        pipe.prefill.reroute = reroute
        core = pipe.prefill_engine.core
        pipe.decode_engine.core.pending["squatter"] = object()  # type: ignore[assignment]  # occupies the slot
        req = GenerateRequest(request_id="waits", token_ids=prompt(67, 20), decode_instance="d0",
                              stream_subject=subjects.stream("t", "waits"),
                              sampling=WireSamplingParams(max_tokens=4, temperature=0.0))
        steps = core.num_steps
        pipe.prefill.submit(req)
        await asyncio.sleep(0.5)
        assert pipe.prefill.waiting == 1 and core.num_steps == steps  # waiting, nothing computed
        assert not pipe.stream.chunks[req.stream_subject]
        pipe.decode_engine.core.pending.clear()  # room
        chunks = await pipe.stream.result("waits")
        assert chunks[-1].finish_reason is WireFinishReason.LENGTH and len(tokens_of(chunks)) == 4
        assert pipe.prefill.stats.waited == 1 and pipe.prefill.waiting == 0

        pipe.prefill.decode_wait_s = 0.6
        pipe.decode_engine.core.pending["squatter"] = object()  # type: ignore[assignment]
        loop = asyncio.get_running_loop()
        started = loop.time()
        chunks = await pipe.generate("gives-up", prompt(68, 20), 4)
        assert loop.time() - started >= 0.5
        assert chunks[-1].finish_reason is WireFinishReason.ERROR and chunks[-1].retryable
        assert "within 0.6s" in chunks[-1].error
        pipe.decode_engine.core.pending.clear()
        await pipe.assert_no_kv_in_use()


async def test_requests_waiting_for_decode_room_are_served_first_come_first_served(tiny):
    """Room for one request at a time: two requests wait, room frees and a third arrives at that moment. They get
    the decode worker in arrival order: only the oldest waiter retries, and a newcomer queues behind the waiters
    instead of taking the room first (it used to: the waiters slept in their backoff)."""
    async with Pipeline(tiny, ucx_config(), max_num_seqs=1) as pipe:
        pipe.prefill.decode_wait_s = 30.0
        served: list[str] = []
        prepare = pipe.prefill.prepare

        async def recording_prepare(decode_instance, msg):
            reply = await prepare(decode_instance, msg)
            served.append(msg.request_id)
            return reply

        async def reroute(request_id, num_tokens, refused):
            return "d0"

        pipe.prefill.prepare, pipe.prefill.reroute = recording_prepare, reroute
        pipe.decode_engine.core.pending["squatter"] = object()  # type: ignore[assignment]  # occupies the slot

        def submit(rid: str, seed: int) -> None:
            pipe.prefill.submit(GenerateRequest(request_id=rid, token_ids=prompt(seed, 20), decode_instance="d0",
                                                stream_subject=subjects.stream("t", rid),
                                                sampling=WireSamplingParams(max_tokens=4, temperature=0.0)))

        async def until_waiting(n: int) -> None:
            async with asyncio.timeout(BOUND_S):
                while pipe.prefill.waiting != n:
                    await asyncio.sleep(0.01)

        submit("a", 70)
        await until_waiting(1)
        submit("b", 71)
        await until_waiting(2)
        await asyncio.sleep(0.3)  # both in their backoff
        pipe.decode_engine.core.pending.clear()  # room for one
        submit("c", 72)
        for rid in ("a", "b", "c"):
            chunks = await pipe.stream.result(rid)
            assert chunks[-1].finish_reason is WireFinishReason.LENGTH and len(tokens_of(chunks)) == 4
        assert served == ["a", "b", "c"]
        assert pipe.prefill.stats.waited == 3 and pipe.prefill.waiting == 0
        await pipe.assert_no_kv_in_use()


async def test_lost_kv_prepare_reply_is_asked_again_and_joins_the_first_reservation(tiny, monkeypatch):
    """The first kv_prepare's reply is lost (a NATS node died or hung with it): prefill asks again after
    COMMIT_ATTEMPT_S, decode answers the repeat from the same hand-off (one reservation, not a duplicate-id
    refusal), and the tokens equal the colocated engine's; every page is back afterwards."""
    from services.prefill import handlers as prefill_handlers

    monkeypatch.setattr(prefill_handlers, "COMMIT_ATTEMPT_S", 0.3)
    model, cfg, _ = tiny
    tokens = prompt(78, 40)
    want = list(LLM.from_core(EngineCore(EngineConfig(**OPTS), model, cfg, None)).generate(
        [tokens], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids)
    async with Pipeline(tiny, ucx_config()) as pipe:
        asks = []

        async def prepare(decode_instance, msg):
            asks.append(msg)
            reply = await pipe.decode.prepare(msg)  # decode took it ...
            if len(asks) == 1:
                await asyncio.sleep(3600)  # ... and its reply never reached prefill
            return reply

        pipe.prefill.prepare = prepare
        chunks = await pipe.generate("lost-reply", tokens, 6)
        assert tokens_of(chunks) == want and chunks[-1].finish_reason is WireFinishReason.LENGTH
        assert len(asks) == 2 and asks[0] == asks[1]
        await pipe.assert_no_kv_in_use()
