"""The engine-worker base (libs/worker): the request-task registry, the wire conversions, the engine's load,
and the three rules every engine role follows since the base is shared (one test per role each):

1. an abort that arrives before its request frees everything: the request never reaches the engine, its
   stream gets the abort final chunk, the pools stay at baseline;
2. stopping the service cancels what is still running after the drain bound: nothing left running, the
   abort final chunk on the stream, the pools at baseline;
3. (metrics of prefill and decode: tests/test_e2e_disagg.py, through the real processes.)

The services run in-process against a real nats-server with the tiny model.
"""

from __future__ import annotations

import asyncio
import math
import uuid
import warnings
from collections.abc import AsyncIterator, Callable

import pytest
import torch

from libs.bus import Bus, RemoteError
from libs.engine import EngineConfig, Request, SamplingParams
from libs.engine import disagg as dg
from libs.engine.request import FinishReason as EngineFinish
from libs.engine.request import RequestOutput, TokenLogprob
from libs.model import load_model
from libs.worker.metrics import Outcomes
from libs.worker.tasks import DuplicateRequest, RequestTasks
from libs.worker.wire import LOGPROB_FLOOR, chunk_from_output, load_from, wire_logprob
from protos import subjects
from protos.messages import (
    AbortRequest,
    AckStatus,
    GenerateAck,
    GenerateRequest,
    KVPrepareReply,
    KVPrepareRequest,
    TokenChunk,
    WireFinishReason,
    WireSamplingParams,
)
from services.decode.config import DecodeConfig
from services.decode.service import DecodeService
from services.prefill.config import PrefillConfig
from services.prefill.service import PrefillService
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService

PAGE = 4
ENGINE = dict(page_size=PAGE, num_full_pages=256, num_swa_pages=96, max_num_batched_tokens=64, bucket_edges=[],
              max_num_seqs=16)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=g).tolist()


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


# ------------------------------------------------------------------------------------------ registry (pure)
async def _sleep_forever(log: list[str], name: str) -> None:
    log.append(f"{name} started")
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await asyncio.sleep(0.01)  # cleanup that itself awaits
        log.append(f"{name} cleaned up")
        raise


async def _note(log: list[str], name: str) -> None:
    log.append(name)


@pytest.mark.unit
async def test_registry_refuses_duplicates_and_closes_what_it_does_not_start():
    tasks, log = RequestTasks(), []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine never awaited would warn
        first = tasks.spawn("a", _sleep_forever(log, "a"), aborted=_note(log, "a aborted"))
        with pytest.raises(DuplicateRequest, match="already running"):
            tasks.spawn("a", _note(log, "second a"), aborted=_note(log, "second a aborted"))
        await asyncio.sleep(0.01)
        assert "a" in tasks and len(tasks) == 1 and log == ["a started"]
        assert await tasks.abort("a") and log == ["a started", "a cleaned up"]  # waited for the cleanup
        assert first.cancelled() and len(tasks) == 0
        # the id is free again once its task ended
        await tasks.spawn("a", _note(log, "a again"))
    assert log[-1] == "a again"


@pytest.mark.unit
async def test_registry_runs_the_aborted_coroutine_when_the_abort_came_first_and_forgets_it_then():
    tasks, log = RequestTasks(), []
    assert not tasks.cancel("early") and tasks.remembers_abort("early")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await tasks.spawn("early", _note(log, "ran"), aborted=_note(log, "told the client"))
    assert log == ["told the client"] and not tasks.remembers_abort("early")
    await tasks.spawn("early", _note(log, "ran"))  # the abort was used once: a later request runs
    assert log == ["told the client", "ran"]


@pytest.mark.unit
async def test_registry_remembers_a_bounded_number_of_aborts():
    tasks = RequestTasks(remember=2)
    for rid in ("x", "y", "z"):
        tasks.cancel(rid)
    assert [tasks.remembers_abort(r) for r in ("x", "y", "z")] == [False, True, True]
    tasks.cancel("y")  # remembered again: now the newest
    tasks.cancel("w")
    assert [tasks.remembers_abort(r) for r in ("y", "z", "w")] == [True, False, True]


@pytest.mark.unit
async def test_drain_waits_for_quick_requests_then_cancels_the_rest_and_waits_for_their_cleanup():
    tasks, log = RequestTasks(), []

    async def quick() -> None:
        await asyncio.sleep(0.05)
        log.append("quick done")

    tasks.spawn("quick", quick())
    tasks.spawn("slow", _sleep_forever(log, "slow"))
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await tasks.drain(0.3, cancel_wait_s=2.0) == 1
    assert 0.3 <= loop.time() - start < 2.0
    assert log == ["slow started", "quick done", "slow cleaned up"] and len(tasks) == 0
    assert await tasks.drain(0.3) == 0  # nothing left: returns at once


# ------------------------------------------------------------------------------------------ wire (pure)
@pytest.mark.unit
def test_chunks_carry_usage_only_when_final_and_logprobs_stay_finite():
    lp = TokenLogprob(7, -math.inf, ((7, -math.inf), (3, -0.5)))
    assert wire_logprob(lp).logprob == LOGPROB_FLOOR and wire_logprob(lp).top == {7: LOGPROB_FLOOR, 3: -0.5}
    mid = chunk_from_output(RequestOutput("r", (5,), (lp,), False, None, 4), "w0", 10, 1)
    assert (mid.token_ids, mid.finish_reason, mid.usage, mid.instance_id) == ([5], None, None, "w0")
    assert mid.logprobs[0].logprob == LOGPROB_FLOOR
    end = chunk_from_output(RequestOutput("r", (6,), None, True, EngineFinish.LENGTH, 4), "w0", 10, 2)
    assert end.finish_reason is WireFinishReason.LENGTH
    assert (end.usage.prompt_tokens, end.usage.completion_tokens, end.usage.cached_tokens) == (10, 2, 4)


@pytest.mark.unit
def test_outcomes_count_final_chunks_only():
    outcomes = Outcomes()
    for reason in (None, WireFinishReason.STOP, WireFinishReason.LENGTH, WireFinishReason.ABORT,
                   WireFinishReason.ERROR, None):
        outcomes.observe(TokenChunk(request_id="r", finish_reason=reason,
                                    error="x" if reason is WireFinishReason.ERROR else None))
    assert outcomes.as_dict() == {"accepted": 0, "refused": 0, "finished": 2, "aborted": 1, "failed": 1}


# ------------------------------------------------------------------------------------------ engine load
@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model(None)


@pytest.mark.integration
async def test_decode_engine_load_counts_remote_requests_waiting_for_their_kv(tiny):
    model, cfg = tiny
    # the static pools: kv_full_total is the full pool's 256 pages (on one arena a group's capacity moves with
    # the other group's use: docs/kvcache.md "One arena")
    engine_cfg = EngineConfig(**{**ENGINE, "bucket_edges": (), "kv_arena": False})
    core = dg.DisaggEngineCore(engine_cfg, model, cfg, None)
    before = core.load()
    assert (before.running, before.waiting, before.usage.full.in_use, before.arrivals) == (0, 0, 0, 0)
    core.add_request(dg.RemoteRequest("remote", prompt(1, 21), SamplingParams(max_tokens=4)))
    core.add_request(Request("local", prompt(2, 9), SamplingParams(max_tokens=4)))
    load = core.load()
    assert (load.running, load.waiting) == (1, 1)  # the remote one holds pages, though not scheduled
    assert load.arrivals == 2  # each counted once, the remote one at its reservation
    assert load.usage.full.in_use == -(-21 // PAGE)
    wire = load_from(load, now=12.5)
    assert (wire.running, wire.waiting, wire.kv_full_used, wire.kv_full_total, wire.updated_at, wire.arrivals) == (
        1, 1, load.usage.full.in_use, 256, 12.5, 2)
    assert (wire.kv_units_used, wire.kv_units_total) == (0, 0)  # static pools: no arena figures
    core.abort("remote")
    core.close()
    # one arena: the load reports its units in use (both groups) or promised, out of all of them
    core = dg.DisaggEngineCore(EngineConfig(**{**ENGINE, "bucket_edges": ()}), model, cfg, None)
    core.add_request(dg.RemoteRequest("remote", prompt(1, 21), SamplingParams(max_tokens=4)))
    load = core.load()
    a = load.usage.arena
    assert a is not None and a.full_in_use > 0 and a.swa_in_use > 0
    wire = load_from(load, now=1.0)
    assert (wire.kv_units_used, wire.kv_units_total) == (a.full_in_use + a.swa_in_use + a.reserved, a.units)
    assert 0 < wire.kv_units_used < wire.kv_units_total
    core.abort("remote")
    core.close()


# ------------------------------------------------------------------------------------------ services
def service_config(cls, nats_url: str, **kw):
    base = dict(nats_url=nats_url, namespace=f"w_{uuid.uuid4().hex[:8]}", registry_ttl_s=2,
                heartbeat_interval_s=0.3, load_interval_s=0.1, **ENGINE)
    return cls(**{**base, **kw})


@pytest.fixture
def tcp_transfer(monkeypatch):
    monkeypatch.setenv("WINDSERVE_TRANSFER", "tcp")  # in-process: the plain-TCP KV transfer engine


async def started(svc):
    await svc.start()
    return svc


class StreamReader:
    def __init__(self, sub) -> None:
        self.sub = sub
        self.chunks: list[TokenChunk] = []

    async def next(self, timeout: float = 10.0) -> TokenChunk:
        chunk = await self.sub.next(timeout)
        self.chunks.append(chunk)
        return chunk

    async def final(self, timeout: float = 20.0) -> TokenChunk:
        async with asyncio.timeout(timeout):
            while True:
                chunk = await self.next(timeout)
                if chunk.finish_reason is not None:
                    return chunk


async def stream(bus: Bus, namespace: str, request_id: str) -> StreamReader:
    sub = await bus.subscribe(subjects.stream(namespace, request_id), TokenChunk)
    await bus.flush()
    return StreamReader(sub)


async def abort_first(bus: Bus, svc, request_id: str) -> None:
    """Broadcast the abort and wait until the service has it (so it surely precedes the request)."""
    await bus.publish(subjects.abort(svc.config.namespace), AbortRequest(request_id=request_id, reason="test"))
    await until(lambda: svc.tasks.remembers_abort(request_id))


async def assert_engine_at_baseline(svc) -> None:
    """Nothing running or waiting, no page in use or reserved (cached pages are free to evict)."""
    if svc.engine.is_running:
        load = await svc.engine.call(lambda core: (core.check_invariants(), core.load())[1], timeout_s=10)
    else:  # stopped: the step loop is gone, read the core directly
        svc.engine.core.check_invariants()
        load = svc.engine.core.load()
    assert (load.running, load.waiting) == (0, 0)
    for pool in (load.usage.full, load.usage.swa):
        assert pool.in_use == 0 and pool.reserved == 0, f"pages still held: {pool}"


def generate_request(namespace: str, request_id: str, tokens: list[int], max_tokens: int,
                     decode_instance: str = "") -> GenerateRequest:
    return GenerateRequest(request_id=request_id, token_ids=tokens,
                           stream_subject=subjects.stream(namespace, request_id),
                           sampling=WireSamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           decode_instance=decode_instance)


def prepare_request(namespace: str, request_id: str, tokens: list[int], max_tokens: int) -> KVPrepareRequest:
    return KVPrepareRequest(request_id=request_id, token_ids=tokens,
                            sampling=WireSamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                            stream_subject=subjects.stream(namespace, request_id), page_size=PAGE,
                            kv_dtype="float32", prefill_instance="test-prefill")


async def ask_generate(bus: Bus, svc, req: GenerateRequest) -> GenerateAck:
    return await bus.request(subjects.generate(svc.config.namespace, svc.config.instance_id), req, GenerateAck, 10)


async def ask_prepare(bus: Bus, svc, msg: KVPrepareRequest) -> KVPrepareReply:
    return await bus.request(subjects.kv_prepare(svc.config.namespace, svc.config.instance_id), msg,
                             KVPrepareReply, 10)


@pytest.fixture
async def unanswered_decode(bus: Bus) -> AsyncIterator[tuple[str, str, asyncio.Event]]:
    """A decode worker that takes kv_prepare and never answers (until the test ends): the prefill holds the
    prompt's KV meanwhile. Yields (namespace, decode instance id, "kv_prepare arrived")."""
    namespace, instance = f"w_{uuid.uuid4().hex[:8]}", "silent-decode"
    arrived, release = asyncio.Event(), asyncio.Event()

    async def hold(msg: KVPrepareRequest) -> KVPrepareReply:
        arrived.set()
        async with asyncio.timeout(60):
            await release.wait()
        raise RuntimeError("released")

    await bus.serve(subjects.kv_prepare(namespace, instance), KVPrepareRequest, hold)
    await bus.flush()
    try:
        yield namespace, instance, arrived
    finally:
        release.set()


# --- 1. an early abort frees everything --------------------------------------------------------------
@pytest.mark.integration
async def test_worker_early_abort_never_reaches_the_engine(bus, nats_url):
    svc = await started(WorkerService(service_config(WorkerConfig, nats_url)))
    try:
        ns = svc.config.namespace
        reader = await stream(bus, ns, "early")
        await abort_first(bus, svc, "early")
        ack = await ask_generate(bus, svc, generate_request(ns, "early", prompt(3, 20), 8))
        assert ack.status is AckStatus.ACCEPTED
        assert (await reader.final()).finish_reason is WireFinishReason.ABORT
        assert [c.token_ids for c in reader.chunks] == [[]]
        await until(lambda: len(svc.tasks) == 0)
        assert (await svc.engine.call(lambda core: core.load())).prompt_tokens == 0  # never admitted
        await assert_engine_at_baseline(svc)
    finally:
        await svc.stop()


@pytest.mark.integration
async def test_prefill_early_abort_never_reaches_the_engine(bus, nats_url, tcp_transfer, unanswered_decode):
    ns, decode, arrived = unanswered_decode
    svc = await started(PrefillService(service_config(PrefillConfig, nats_url, namespace=ns)))
    try:
        reader = await stream(bus, ns, "early")
        await abort_first(bus, svc, "early")
        ack = await ask_generate(bus, svc, generate_request(ns, "early", prompt(4, 30), 8, decode))
        assert ack.status is AckStatus.ACCEPTED
        assert (await reader.final()).finish_reason is WireFinishReason.ABORT
        await until(lambda: len(svc.tasks) == 0)
        assert not arrived.is_set()  # no hand-off was attempted
        assert (await svc.engine.call(lambda core: core.load())).prompt_tokens == 0
        await assert_engine_at_baseline(svc)
        assert svc.outcomes.aborted == 1 and svc.outcomes.accepted == 1
    finally:
        await svc.stop()


@pytest.mark.integration
async def test_decode_early_abort_admits_nothing_and_refuses_kv_prepare(bus, nats_url, tcp_transfer):
    svc = await started(DecodeService(service_config(DecodeConfig, nats_url)))
    try:
        ns = svc.config.namespace
        reader = await stream(bus, ns, "early")
        await abort_first(bus, svc, "early")
        with pytest.raises(RemoteError, match="aborted before"):
            await ask_prepare(bus, svc, prepare_request(ns, "early", prompt(5, 30), 8))
        assert (await reader.final()).finish_reason is WireFinishReason.ABORT
        assert [c.token_ids for c in reader.chunks] == [[]]  # not even the first token
        await until(lambda: len(svc.tasks) == 0)
        assert (await svc.engine.call(lambda core: core.load())).prompt_tokens == 0
        await assert_engine_at_baseline(svc)
    finally:
        await svc.stop()


# --- 2. stopping cancels what is left after the drain bound -----------------------------------------
DRAIN = dict(drain_timeout_s=0.5)


def assert_cut_by_the_drain_bound(final: TokenChunk) -> None:
    """A worker or decode worker's stream cut at the drain bound ends as the worker's failure, so the gateway moves
    it to a live worker (a prefill worker's held request ends as an abort: it has sent no token)."""
    assert final.finish_reason is WireFinishReason.ERROR and final.instance_failed, final
    assert "drain bound reached" in (final.error or ""), final


@pytest.mark.integration
async def test_worker_stop_cancels_a_long_request_after_the_drain_bound(bus, nats_url):
    svc = await started(WorkerService(service_config(WorkerConfig, nats_url, **DRAIN)))
    ns = svc.config.namespace
    reader = await stream(bus, ns, "long")
    ack = await ask_generate(bus, svc, generate_request(ns, "long", prompt(6, 20), 900))
    assert ack.status is AckStatus.ACCEPTED
    await reader.next()  # it runs
    await asyncio.wait_for(svc.stop(), 15)
    assert_cut_by_the_drain_bound(await reader.final())
    assert len(svc.tasks) == 0
    await assert_engine_at_baseline(svc)


@pytest.mark.integration
async def test_prefill_stop_cancels_a_request_holding_kv_after_the_drain_bound(bus, nats_url, tcp_transfer,
                                                                              unanswered_decode):
    ns, decode, arrived = unanswered_decode
    svc = await started(PrefillService(service_config(PrefillConfig, nats_url, namespace=ns,
                                                      prepare_timeout_s=30, **DRAIN)))
    reader = await stream(bus, ns, "held")
    ack = await ask_generate(bus, svc, generate_request(ns, "held", prompt(7, 30), 8, decode))
    assert ack.status is AckStatus.ACCEPTED
    await asyncio.wait_for(arrived.wait(), 10)  # prefilled: the prompt's KV is held, kv_prepare unanswered
    await asyncio.wait_for(svc.stop(), 15)
    assert (await reader.final()).finish_reason is WireFinishReason.ABORT
    assert len(svc.worker.tasks) == 0
    await assert_engine_at_baseline(svc)


@pytest.mark.integration
async def test_decode_stop_cancels_a_request_waiting_for_its_kv_after_the_drain_bound(bus, nats_url, tcp_transfer):
    svc = await started(DecodeService(service_config(DecodeConfig, nats_url, transfer_timeout_s=30, **DRAIN)))
    ns = svc.config.namespace
    reader = await stream(bus, ns, "waits")
    reply = await ask_prepare(bus, svc, prepare_request(ns, "waits", prompt(8, 30), 8))
    assert reply.address  # admitted: pages reserved for KV that never comes (nothing is published before kv_commit)
    await asyncio.wait_for(svc.stop(), 15)
    assert_cut_by_the_drain_bound(await reader.final())
    assert len(svc.worker.tasks) == 0
    await assert_engine_at_baseline(svc)


@pytest.mark.integration
async def test_decode_answers_kv_prepare_with_its_advertised_address_when_binding_every_interface(bus, nats_url,
                                                                                                 tcp_transfer):
    """Under compose the transfer engine binds 0.0.0.0; prefill must be told the address peers can dial (this
    host's IP, as in the registry entry), not the wildcard it bound (seen: `cannot connect ... 0.0.0.0`)."""
    svc = await started(DecodeService(service_config(DecodeConfig, nats_url, transfer_host="0.0.0.0",
                                                     transfer_timeout_s=30, **DRAIN)))
    ns = svc.config.namespace
    reader = await stream(bus, ns, "where")
    reply = await ask_prepare(bus, svc, prepare_request(ns, "where", prompt(9, 30), 8))
    assert "0.0.0.0" not in reply.address and reply.address == svc.address
    await asyncio.wait_for(svc.stop(), 15)
    assert_cut_by_the_drain_bound(await reader.final())
    await assert_engine_at_baseline(svc)


# --- 4. a stuck engine fails the worker --------------------------------------------------------------------
@pytest.mark.integration
async def test_a_worker_whose_engine_is_stuck_fails_its_requests_as_gone_deregisters_and_exits_70(bus, nats_url):
    """The step loop stuck in one round (here: a command that never returns, as a dead lock or a kernel that
    hangs would): within `engine_stall_s` the in-flight request's error chunk says the instance failed (the
    gateway retries such a request elsewhere before its first token), the worker leaves the registry and its
    `run()` ends with exit code 70. Without the watch the request waits `output_timeout_s` (300 s) and the
    worker stays registered, taking new requests."""
    import concurrent.futures
    import threading

    from libs.bus import Registry
    from protos.messages import Role, ServiceState

    svc = WorkerService(service_config(WorkerConfig, nats_url, engine_stall_s=1.0, **DRAIN))
    runner = asyncio.create_task(svc.run())
    gate = threading.Event()
    try:
        await until(lambda: svc.state is ServiceState.RUNNING, 60)
        ns = svc.config.namespace
        registry = await Registry.open(bus, bucket=subjects.registry_bucket(ns))
        assert [e.instance_id for e in await registry.list(Role.WORKER)] == [svc.config.instance_id]
        reader = await stream(bus, ns, "stuck")
        assert (await ask_generate(bus, svc, generate_request(ns, "stuck", prompt(6, 20), 900))).status is \
            AckStatus.ACCEPTED
        await reader.next()  # it runs
        assert svc.engine is not None
        svc.engine._commands.put((lambda: gate.wait(60), concurrent.futures.Future()))  # the loop is stuck from here
        final = await reader.final(timeout=15)
        assert final.finish_reason is WireFinishReason.ERROR and final.instance_failed
        assert "stuck in one round" in (final.error or "")
        await asyncio.wait_for(runner, 20)
        assert svc.exit_code == 70 and svc.state is ServiceState.STOPPED
        assert await registry.list(Role.WORKER) == []  # deregistered on the way out
    finally:
        gate.set()
        svc.request_stop()
        await asyncio.wait_for(asyncio.shield(runner), 30)
