"""Token chunks lost in transit (core NATS delivers at most once: a node that dies or hangs drops what it held).

The worker side numbers and keeps each request's chunks (`libs/worker/stream_ledger.py`, pure: unit tests
below); the gateway fetches what it missed, on a gap or after a silent interval (services/gateway/backend.py),
over a real nats-server with a worker that "loses" chunks by numbering them without publishing them. The
reference is the same stream without losses. The real-process case is tests/test_faults.py's hung NATS node."""

from __future__ import annotations

import asyncio

import pytest

from libs.bus import Bus
from libs.worker.stream_ledger import StreamLedger
from protos import subjects
from protos.messages import (
    GenerateAck,
    GenerateRequest,
    RegistryEntry,
    Role,
    StreamReplayReply,
    StreamReplayRequest,
    TokenChunk,
    WireFinishReason,
    WireSamplingParams,
    WorkerLoad,
)
from services.gateway import metrics
from services.gateway.backend import BackendConfig, BackendError, NatsBackend

NS = "replay"
TOKENS = [[1], [2], [3], [4, 5], [6]]  # the last chunk finishes the request


def _chunk(rid: str, k: int, instance: str = "w") -> TokenChunk:
    final = k == len(TOKENS) - 1
    return TokenChunk(request_id=rid, instance_id=instance, token_ids=TOKENS[k],
                      finish_reason=WireFinishReason.LENGTH if final else None)


# --- the ledger (pure) -----------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_chunks_are_numbered_per_request_from_zero_and_replayed_from_any_point():
    ledger = StreamLedger()
    seqs = [ledger.number(_chunk("a", k)).seq for k in range(3)] + [ledger.number(_chunk("b", 0)).seq]
    assert seqs == [0, 1, 2, 0]
    reply = ledger.replay("a", 1)
    assert reply.known and reply.first_kept == 0 and [c.token_ids for c in reply.chunks] == [[2], [3]]
    assert ledger.replay("a", 3).chunks == [] and not ledger.replay("nope", 0).known


def test_only_the_last_keep_chunks_are_held_and_first_kept_says_so():
    ledger = StreamLedger(keep_chunks=2)
    for k in range(4):
        ledger.number(_chunk("a", k))
    reply = ledger.replay("a", 0)
    assert reply.first_kept == 2 and [c.seq for c in reply.chunks] == [2, 3]


def test_a_finished_stream_is_kept_for_keep_s_then_forgotten_and_a_reused_id_starts_again():
    clock = Clock()
    ledger = StreamLedger(keep_s=10, clock=clock)
    for k in range(len(TOKENS)):
        ledger.number(_chunk("a", k))
    clock.now = 9.0
    assert ledger.replay("a", 4).known
    clock.now = 10.5
    assert not ledger.replay("a", 0).known and len(ledger) == 0
    for k in range(len(TOKENS)):
        ledger.number(_chunk("b", k))
    assert ledger.number(_chunk("b", 0)).seq == 0  # the same id after its final chunk: a new stream


def test_past_max_requests_the_oldest_finished_stream_goes_first_then_the_oldest():
    ledger = StreamLedger(max_requests=2)
    ledger.number(_chunk("running", 0))
    for k in range(len(TOKENS)):
        ledger.number(_chunk("done", k))
    ledger.number(_chunk("new", 0))
    assert ledger.replay("running", 0).known and ledger.replay("new", 0).known and not ledger.replay("done", 0).known
    ledger.number(_chunk("newer", 0))
    assert not ledger.replay("running", 0).known and len(ledger) == 2


# --- the gateway over a real nats-server ----------------------------------------------------------------------


class LossyWorker:
    """A combined worker whose chunks go through a StreamLedger; the chunk numbers in `drop` are numbered and
    kept but never published (what a failing NATS node does to them)."""

    def __init__(self, bus: Bus, instance: str, drop: set[int], keep_chunks: int = 1024) -> None:
        self.bus, self.instance, self.drop = bus, instance, drop
        self.ledger = StreamLedger(keep_chunks=keep_chunks)

    async def start(self) -> LossyWorker:
        await self.bus.serve(subjects.generate(NS, self.instance), GenerateRequest, self._generate)
        await self.bus.serve(subjects.stream_replay(NS, self.instance), StreamReplayRequest, self._replay)
        return self

    async def _replay(self, req: StreamReplayRequest) -> StreamReplayReply:
        return self.ledger.replay(req.request_id, req.from_seq)

    async def _generate(self, req: GenerateRequest) -> GenerateAck:
        asyncio.get_running_loop().call_later(0.05, lambda: asyncio.ensure_future(self._stream(req)))
        return GenerateAck(request_id=req.request_id, instance_id=self.instance)

    async def _stream(self, req: GenerateRequest) -> None:
        for k in range(len(TOKENS)):
            chunk = self.ledger.number(_chunk(req.request_id, k, self.instance))
            if k not in self.drop:
                await self.bus.publish(req.stream_subject, chunk)
            await asyncio.sleep(0.01)


def _backend(bus: Bus) -> NatsBackend:
    async def list_services() -> list[RegistryEntry]:
        return [RegistryEntry(role=Role.WORKER, instance_id="w", load=WorkerLoad())]
    return NatsBackend(bus, list_services, BackendConfig(liveness_interval_s=0.2, ack_timeout_s=2, route_timeout_s=1,
                                                         fleet_cache_s=0.0), namespace=NS)


async def _tokens(bus: Bus) -> list[list[int]]:
    chunks = [c async for c in _backend(bus).generate("req", [5, 6, 7], WireSamplingParams(max_tokens=6))]
    return [c.token_ids for c in chunks]


@pytest.mark.integration
@pytest.mark.timeout(60)
@pytest.mark.parametrize("drop, gaps", [(set(), 0), ({0}, 1), ({1, 2}, 1), ({4}, 1), ({0, 2, 4}, 3)],
                         ids=["none", "first", "middle", "final", "several"])
async def test_chunks_lost_in_transit_are_fetched_again_and_the_stream_is_whole(bus, drop, gaps):
    """A gap (a later chunk came) or a silence (the final chunk never came) is filled from the worker: the
    client gets exactly the tokens it would have without the loss, in order, each once."""
    await LossyWorker(bus, "w", drop).start()
    before = metrics.STREAM_GAPS._value.get()
    async with asyncio.timeout(20):
        assert await _tokens(bus) == TOKENS
    assert metrics.STREAM_GAPS._value.get() - before == gaps


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_chunks_the_worker_no_longer_holds_fail_the_request_explicitly(bus):
    await LossyWorker(bus, "w", drop={1}, keep_chunks=1).start()
    with pytest.raises(BackendError) as err:
        async with asyncio.timeout(20):
            await _tokens(bus)
    assert (err.value.status, err.value.code) == (503, "stream_lost") and "chunks 1..1 from w" in err.value.message
