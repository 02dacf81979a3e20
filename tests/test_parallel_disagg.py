"""Disaggregated serving with parallel engines (#18): prefill and decode services (in-process, a real
nats-server, the plain-TCP KV transfer) whose engines run tp / ep rank processes, against the colocated
single-process engine. The wire holds every KV head, so prefill and decode may run different tp: a tp prefill
gathers its ranks' head slices, a parallel decode scatters them to its ranks (libs/engine/parallel/kvio.py).

One set of engines for the module (a rank process takes seconds to start on a busy machine):
prefill tp=2, prefill tp=1, decode tp=2, decode tp=1, decode ep=2 (tp=1: every rank a replica of the KV).
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
import pytest_asyncio
import torch

from libs.bus import Bus
from libs.engine import LLM, EngineConfig, EngineCore, Request, SamplingParams
from libs.engine import disagg as dg
from libs.engine.parallel.kvio import head_owners
from libs.engine.parallel.layout import ParallelLayout
from libs.engine.plan import BatchPlan
from libs.model import load_model
from libs.model.config import ModelConfig
from services.decode.config import DecodeConfig
from services.decode.service import DecodeService
from services.prefill.config import PrefillConfig
from services.prefill.service import PrefillService
from tests.test_engine import assert_baseline, drain
from tests.test_worker import (
    ENGINE,
    ask_generate,
    assert_engine_at_baseline,
    generate_request,
    prompt,
    service_config,
    stream,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ASYNC = pytest.mark.asyncio(loop_scope="module")

LAYOUTS = {"p_tp2": (PrefillService, PrefillConfig, 2, 1), "p_tp1": (PrefillService, PrefillConfig, 1, 1),
           "d_tp2": (DecodeService, DecodeConfig, 2, 1), "d_tp1": (DecodeService, DecodeConfig, 1, 1),
           "d_ep2": (DecodeService, DecodeConfig, 1, 2)}
# prompt lengths: one page, several 64-token streamed segments, and in between (window: 16 tokens)
LENGTHS = (5, 37, 150)


@pytest.mark.unit
def test_every_kv_head_is_gathered_once_from_the_lowest_rank_that_holds_it():
    cfg = ModelConfig.tiny().with_(kv_heads_full=1, kv_heads_swa=2)
    wide = cfg.with_(num_heads=8, kv_heads_full=4, kv_heads_swa=8)
    assert head_owners(ParallelLayout(tp=2), cfg, swa=False) == [(0, range(0, 1))]  # replicated on both ranks
    assert head_owners(ParallelLayout(tp=2), cfg, swa=True) == [(0, range(0, 1)), (1, range(1, 2))]
    assert head_owners(ParallelLayout(ep=2), cfg, swa=True) == [(0, range(0, 2))]  # ep alone: replicas
    assert head_owners(ParallelLayout(tp=4), cfg, swa=True) == [(0, range(0, 1)), (2, range(1, 2))]
    assert head_owners(ParallelLayout(tp=4, ep=4), wide, swa=False) == [(r, range(r, r + 1)) for r in range(4)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def services(nats_server):
    """The five services of the module (one namespace), and a bus to drive them."""
    ns = f"pd_{uuid.uuid4().hex[:6]}"
    saved = os.environ.get("WINDSERVE_TRANSFER")
    os.environ["WINDSERVE_TRANSFER"] = "tcp"  # in-process: the plain-TCP KV transfer engine
    svcs = {name: cls(service_config(config, nats_server.url, namespace=ns, instance_id=name, tp=tp, ep=ep))
            for name, (cls, config, tp, ep) in LAYOUTS.items()}
    bus = await Bus.connect(nats_server.url, name="test-parallel-disagg")
    try:
        await asyncio.gather(*(svc.start() for svc in svcs.values()))
        yield svcs, bus
    finally:
        await asyncio.gather(*(svc.stop() for svc in svcs.values()), return_exceptions=True)
        await bus.close()
        if saved is None:
            os.environ.pop("WINDSERVE_TRANSFER", None)
        else:
            os.environ["WINDSERVE_TRANSFER"] = saved


@pytest.fixture(scope="module")
def tiny_model():
    return load_model(None)


@pytest.fixture(scope="module")
def colocated():
    return LLM(None, **{**ENGINE, "bucket_edges": ()})


def expected(colocated, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return [list(o.token_ids) for o in colocated.generate(prompts, SamplingParams(max_tokens=max_tokens,
                                                                                  ignore_eos=True))]


async def hand_off(services, prefill: str, decode: str, tag: str, prompts: list[list[int]],
                   max_tokens: int) -> list[list[int]]:
    """Every prompt through `prefill` to `decode` (concurrently); the greedy tokens of each."""
    svcs, bus = services

    async def one(i: int, tokens: list[int]) -> list[int]:
        rid, ns = f"{tag}-{i}", svcs[prefill].config.namespace
        reader = await stream(bus, ns, rid)
        try:
            ack = await ask_generate(bus, svcs[prefill], generate_request(ns, rid, tokens, max_tokens, decode))
            assert ack.status.value == "accepted", ack
            final = await reader.final(timeout=60)  # (generous: rank processes share two busy cores)
        finally:
            await reader.sub.unsubscribe()
        assert final.error is None and final.finish_reason.value == "length", final
        return [t for c in reader.chunks for t in c.token_ids]

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def at_baseline(services, *names: str) -> None:
    svcs, _ = services
    for name in names:
        await assert_engine_at_baseline(svcs[name])


async def rank_sends(services, name: str) -> list[int]:
    """Bytes each rank of the service's engine has sent point to point (the KV hand-off's head slices)."""
    svc = services[0][name]
    stats = await svc.engine.call(lambda core: core.runner.rank_stats())
    return [s.send_bytes for s, _ in stats]


@ASYNC
async def test_tp2_prefill_and_tp2_decode_equal_colocated_also_on_a_follow_up_hit(services, colocated):
    prompts = [prompt(10 + i, n) for i, n in enumerate(LENGTHS)]
    got = await hand_off(services, "p_tp2", "d_tp2", "same", prompts, 8)
    assert got == expected(colocated, prompts, 8)
    # the follow-up turn hits on both sides: decode's hit pages live on every rank, only the rest is shipped
    follow = prompts[2] + got[2] + prompt(20, 30)
    assert await hand_off(services, "p_tp2", "d_tp2", "follow", [follow], 6) == expected(colocated, [follow], 6)
    await at_baseline(services, "p_tp2", "d_tp2")
    # the head slices travelled over each engine's group: prefill's rank 1 to rank 0, decode's rank 0 to rank 1
    assert (await rank_sends(services, "p_tp2"))[1] > 0
    assert (await rank_sends(services, "d_tp2"))[0] > 0


@ASYNC
@pytest.mark.parametrize("prefill,decode", [("p_tp2", "d_tp1"), ("p_tp1", "d_tp2"), ("p_tp1", "d_ep2")])
async def test_prefill_and_decode_of_different_layouts_equal_colocated(services, colocated, prefill, decode):
    """Re-split on arrival: tp 2 -> 1 (gathered on prefill, plain pool on decode), 1 -> 2 (plain on prefill,
    scattered on decode), and a replicated-KV ep decode (every rank needs the whole shipment)."""
    prompts = [prompt(30 + i, n) for i, n in enumerate(LENGTHS)]
    assert await hand_off(services, prefill, decode, f"{prefill}-{decode}", prompts, 8) == \
        expected(colocated, prompts, 8)
    await at_baseline(services, prefill, decode)


def _ship(src: EngineCore, dst: dg.DisaggEngineCore, rid: str, tokens: list[int], first: int) -> None:
    """What prefill and decode do over the wire, in-process: the plan's pages of `src`'s held prefill through
    its KVAccess into `dst`'s (landed by activate, on `dst`'s engine thread: this one)."""
    held = src.held_prefill(rid)
    pending = dst.pending[rid]
    plan = dg.plan_stream(len(tokens), src.config.page_size, src.cache.cfg.window, pending.hit_tokens)
    full, swa = dst.cache.page_tables(rid)
    out = src.runner.kv_access().gather(dg.stream_layers(src.kv_layer_is_swa, plan, held.full_pages,
                                                           held.swa_pages))
    landing = dst.runner.kv_access().receive(dg.stream_layers(dst.kv_layer_is_swa, plan, full, swa))
    for payload, dest in zip(out, landing.payloads, strict=True):
        flat, at = torch.cat([t.reshape(-1) for t in payload]), 0
        for d in dest:
            d.copy_(flat[at: at + d.numel()].view_as(d))
            at += d.numel()
    dst.activate(rid, first, landing.land)


@ASYNC
@pytest.mark.parametrize("arena", [False, True])
async def test_a_host_tier_hit_on_a_parallel_decode_is_loaded_on_every_rank(tiny_model, colocated, arena):
    """A remote prompt whose prefix hit sits in the decode engine's host tier (L2): its pages are loaded back
    at admission on every rank, each from its own host tier (they were loaded on rank 0 only). ep=2: every rank
    holds a replica of the whole KV and feeds the MoE's all-reduce, so a stale one changes the tokens. With the
    static pools and with one arena per rank (rank 0's units: the other ranks hold no unit tables).
    (Engine cores driven from a thread: the module's event loop, which runs the services, keeps running.)"""
    await asyncio.to_thread(_host_tier_hit, tiny_model, colocated, arena)


def _host_tier_hit(tiny_model, colocated, arena: bool) -> None:
    model, cfg = tiny_model
    opts = {**ENGINE, "bucket_edges": (), "num_full_pages": 24, "num_swa_pages": 24, "num_host_full_pages": 64,
            "num_host_swa_pages": 64, "kv_arena": arena}
    decode = dg.DisaggEngineCore(EngineConfig(**opts, ep=2), model, cfg)
    assert (decode.runner.kv.arena is not None) == arena
    source = EngineCore(EngineConfig(**{**ENGINE, "bucket_edges": ()}), model, cfg)
    try:
        first_turn = prompt(50, 40)
        decode.add_request(Request("a", first_turn, SamplingParams(max_tokens=1, ignore_eos=True)))
        drain(decode)
        decode.runner.forward(BatchPlan(backup_copies=tuple(decode.cache.backup_to_host(100))))
        # (80 tokens fill the static full pool; the arena's bytes hold more: 120 evict a's device pages there)
        decode.add_request(Request("b", prompt(51, 120 if arena else 80), SamplingParams(max_tokens=1,
                                                                                         ignore_eos=True)))
        drain(decode)  # evicts a's device pages (their host copies stay)
        tokens = first_turn + prompt(52, 13)
        greedy = SamplingParams(max_tokens=6, ignore_eos=True)
        decode.add_request(dg.RemoteRequest("r", tokens, greedy))
        assert decode.pending["r"].host_tokens > 0  # the hit came back from the host tier
        source.add_request(Request("r", tokens, greedy, prefill_only=True))
        first = drain(source)["r"][0]
        _ship(source, decode, "r", tokens, first)
        source.release("r")
        assert [first, *drain(decode)["r"]] == expected(colocated, [tokens], 6)[0]
        for core in (decode, source):
            assert_baseline(core)
    finally:
        decode.close()
        source.close()


@ASYNC
async def test_tp2_arena_prefill_hands_off_to_a_tp2_arena_decode():
    """Both sides tp = 2 over one KV arena per rank (a model whose 2 full / 4 SWA KV heads split alike): the
    prefill gathers every rank's heads by rank 0's units, the decode scatters them into its ranks' arenas by its
    own units; a follow-up turn with a device prefix hit on the decode side too. Greedy tokens equal one process
    without a prefix cache; pools back to baseline."""
    await asyncio.to_thread(_arena_hand_off)


def _arena_hand_off() -> None:
    from tests.test_parallel import even_heads_model

    model, cfg = even_heads_model()
    opts = {**ENGINE, "bucket_edges": ()}
    ref = EngineCore(EngineConfig(**opts, enable_prefix_cache=False), model, cfg)
    source = EngineCore(EngineConfig(**opts, tp=2), model, cfg)
    decode = dg.DisaggEngineCore(EngineConfig(**opts, tp=2), model, cfg)
    try:
        assert source.runner.kv.arena is not None and decode.runner.kv.arena is not None
        greedy = SamplingParams(max_tokens=6, ignore_eos=True)
        history = prompt(60, 45)
        for turn in range(2):
            tokens = history + prompt(61 + turn, 11)
            ref.add_request(Request(f"ref{turn}", tokens, greedy))
            want = drain(ref)[f"ref{turn}"]
            rid = f"r{turn}"
            decode.add_request(dg.RemoteRequest(rid, tokens, greedy))
            source.add_request(Request(rid, tokens, greedy, prefill_only=True))
            first = drain(source)[rid][0]
            _ship(source, decode, rid, tokens, first)
            source.release(rid)
            got = [first, *drain(decode)[rid]]
            assert got == want, f"turn {turn}"
            history = tokens + got
        assert decode.scheduler.stats.hit_tokens > 0  # the follow-up's prefix was on the decode side already
        for core in (decode, source):
            assert_baseline(core)
    finally:
        for core in (ref, source, decode):
            core.close()
