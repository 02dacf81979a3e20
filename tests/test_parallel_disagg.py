"""Disaggregated serving with parallel engines (#18): prefill and decode services (in-process, a real
nats-server, the plain-TCP KV transfer) whose engines run tp / ep rank processes, against the colocated
single-process engine. The wire holds every KV head, so prefill and decode may run different tp: a tp prefill
gathers its ranks' head slices, a parallel decode scatters them to its ranks (libs/parallel/kvio.py).

One set of engines for the module (a rank process takes seconds to start on a busy machine):
prefill tp=2, prefill tp=1, decode tp=2, decode tp=1, decode ep=2 (tp=1: every rank a replica of the KV).
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
import pytest_asyncio

from libs.bus import Bus
from libs.engine import LLM, SamplingParams
from services.decode.config import DecodeConfig
from services.decode.service import DecodeService
from services.prefill.config import PrefillConfig
from services.prefill.service import PrefillService
from tests.test_kv_events import serve
from tests.test_worker import ENGINE, assert_engine_at_baseline, prompt, service_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

LAYOUTS = {"p_tp2": (PrefillService, PrefillConfig, 2, 1), "p_tp1": (PrefillService, PrefillConfig, 1, 1),
           "d_tp2": (DecodeService, DecodeConfig, 2, 1), "d_tp1": (DecodeService, DecodeConfig, 1, 1),
           "d_ep2": (DecodeService, DecodeConfig, 1, 2)}
# prompt lengths: one page, several 64-token streamed segments, and in between (window: 16 tokens)
LENGTHS = (5, 37, 150)


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
        final, out = await serve(bus, svcs[prefill], f"{tag}-{i}", tokens, max_tokens, decode=decode)
        assert final.error is None and final.finish_reason.value == "length", final
        return out

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


@pytest.mark.parametrize("prefill,decode", [("p_tp2", "d_tp1"), ("p_tp1", "d_tp2"), ("p_tp1", "d_ep2")])
async def test_prefill_and_decode_of_different_layouts_equal_colocated(services, colocated, prefill, decode):
    """Re-split on arrival: tp 2 -> 1 (gathered on prefill, plain pool on decode), 1 -> 2 (plain on prefill,
    scattered on decode), and a replicated-KV ep decode (every rank needs the whole shipment)."""
    prompts = [prompt(30 + i, n) for i, n in enumerate(LENGTHS)]
    assert await hand_off(services, prefill, decode, f"{prefill}-{decode}", prompts, 8) == \
        expected(colocated, prompts, 8)
    await at_baseline(services, prefill, decode)
