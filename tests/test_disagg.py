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
from libs.transfer import Backend, TransferConfig, create_engine
from protos import subjects
from protos.messages import FinishReason, GenerateRequest, TokenChunk
from protos.messages import SamplingParams as WireParams
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
        self.tx = create_engine(transfer_config, Backend.UCX)
        self.rx = create_engine(transfer_config, Backend.UCX)
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
                              sampling=WireParams(max_tokens=max_tokens, temperature=0.0), decode_instance="d0")
        await self.prefill.submit(req)
        return await self.stream.result(request_id)

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
        assert chunks[-1].finish_reason is FinishReason.LENGTH
        assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens > 0
    assert tokens_of(results[2]) == direct_greedy(model, cfg, prompts[2], 10, page_size=PAGE)


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
        errors = [c for c in chunks if c.finish_reason is FinishReason.ERROR]
        assert errors and "mid-transfer" in errors[0].error
        assert took < BOUND_S  # signalled explicitly, far below the 30 s transfer timeouts
        await asyncio.sleep(0.2)  # the decode side's cleanup runs after its error chunk
        await pipe.assert_no_kv_in_use()
        # both sides still serve correctly afterwards
        pipe.prefill.transfer = pipe.tx
        ok = await pipe.generate("after", prompt(22, 30), 4)
        assert ok[-1].finish_reason is FinishReason.LENGTH


async def test_decode_engine_full_is_refused_and_prefill_frees(tiny):
    async with Pipeline(tiny, ucx_config(), max_num_seqs=1) as pipe:
        pipe.decode_engine.core.pending["squatter"] = object()  # type: ignore[assignment]  # occupies the slot
        chunks = await pipe.generate("refused", prompt(31, 20), 4)
        assert chunks[-1].finish_reason is FinishReason.ERROR and "full" in chunks[-1].error
        pipe.decode_engine.core.pending.clear()
        await pipe.assert_no_kv_in_use()


async def test_abort_right_after_prefill_frees_the_held_kv(tiny, monkeypatch):
    """The client leaves while the prefill worker asks the engine about the first token (the prompt's KV is
    held by then): the request ends with an abort and the held KV is released, not leaked."""
    async with Pipeline(tiny, ucx_config()) as pipe:
        loop = asyncio.get_running_loop()
        reached, go = asyncio.Event(), threading.Event()
        check = dg.first_token_finishes

        def gated(core, params, token):  # runs on the engine thread
            loop.call_soon_threadsafe(reached.set)
            go.wait(10)
            return check(core, params, token)

        monkeypatch.setattr(dg, "first_token_finishes", gated)
        req = GenerateRequest(request_id="gone", token_ids=prompt(41, 40), stream_subject=subjects.stream("t", "gone"),
                              sampling=WireParams(max_tokens=4, temperature=0.0), decode_instance="d0")
        pipe.prefill.submit(req)
        await asyncio.wait_for(reached.wait(), 30)
        abort = asyncio.ensure_future(pipe.prefill.abort("gone"))
        await asyncio.sleep(0.05)  # the cancel lands while the engine call is in flight
        go.set()
        assert await asyncio.wait_for(abort, 10)
        chunks = await pipe.stream.result("gone")
        assert chunks[-1].finish_reason is FinishReason.ABORT
        await pipe.assert_no_kv_in_use()


# ------------------------------------------------------------------------------------------ router pairs
def _entry(role, iid, running=0, waiting=0, buckets=(), address="ucx://h:1", used=0):
    from protos.messages import RegistryEntry, WorkerLoad
    return RegistryEntry(role=role, instance_id=iid, address=address, buckets=list(buckets),
                         load=WorkerLoad(running=running, waiting=waiting, kv_full_used=used, kv_full_total=100))


@pytest.mark.unit
def test_pick_pair_by_bucket_and_load():
    from protos.messages import Role
    from services.router.handlers import pick_pair
    prefills = [_entry(Role.PREFILL, "p-short", buckets=[0]), _entry(Role.PREFILL, "p-long", buckets=[1], waiting=5),
                _entry(Role.PREFILL, "p-any", running=7)]
    decodes = [_entry(Role.DECODE, "d-busy", running=3), _entry(Role.DECODE, "d-idle", used=50),
               _entry(Role.DECODE, "d-noaddr", address="")]
    edges = [100]
    assert [e.instance_id for e in pick_pair(prefills, decodes, 10, edges, "q")] == ["p-short", "d-idle"]
    # long prompt: only p-long and the catch-all p-any serve bucket 1; p-long has the shorter queue
    assert pick_pair(prefills, decodes, 500, edges, "q")[0].instance_id == "p-long"
    # this router's own recent picks count as load (a burst between two registry refreshes spreads)
    assert pick_pair(prefills, decodes, 10, edges, "q", {"p-short": 9, "d-idle": 9})[1].instance_id == "d-busy"
    # equal load: ties broken by the KV share, then by a deterministic hash
    same = [_entry(Role.DECODE, f"d{i}") for i in range(4)]
    picks = {pick_pair(prefills, same, 10, edges, f"r{i}")[1].instance_id for i in range(40)}
    assert len(picks) > 1 and pick_pair(prefills, same, 10, edges, "r1") == pick_pair(prefills, same, 10, edges, "r1")


@pytest.mark.unit
def test_pick_pair_needs_both_roles_and_an_address():
    from protos.messages import Role
    from services.router.handlers import RecentPicks, pick_pair
    with pytest.raises(LookupError, match="prefill"):
        pick_pair([], [_entry(Role.DECODE, "d")], 1, [], "q")
    with pytest.raises(LookupError, match="transfer address"):
        pick_pair([_entry(Role.PREFILL, "p")], [_entry(Role.DECODE, "d", address="")], 1, [], "q")
    # decode workers that refused the request (full) are not offered again
    two = [_entry(Role.DECODE, "d0"), _entry(Role.DECODE, "d1")]
    assert pick_pair([_entry(Role.PREFILL, "p")], two, 1, [], "q", exclude_decodes=["d0"])[1].instance_id == "d1"
    with pytest.raises(LookupError, match="besides"):
        pick_pair([_entry(Role.PREFILL, "p")], two, 1, [], "q", exclude_decodes=["d0", "d1"])
    recent = RecentPicks(window_s=2.0)
    recent.add("a", 10.0)
    recent.add("a", 11.5)
    assert recent.counts(11.9) == {"a": 2} and recent.counts(13.0) == {"a": 1} and recent.counts(20) == {}
    # picks older than the instance's load snapshot are in that load already: not counted twice
    recent.add("a", 30.0)
    recent.add("a", 30.4)
    recent.add("b", 30.1)
    assert recent.counts(30.5, {"a": 30.2, "b": 29.0}) == {"a": 1, "b": 1}
    assert recent.counts(30.5, {"a": 30.45}) == {"b": 1}
