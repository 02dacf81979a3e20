"""Gateway failover over a real nats-server, with workers that are small fakes on the bus (the failure
modes are what is under test: gone, busy, dying before or after the first chunk, a router that ignores
exclusions, no router, NATS down); plus the pure size check and fallback choice (services/gateway/failover.py).
The same paths on real processes: tests/test_faults.py."""

from __future__ import annotations

import asyncio
import signal
import tempfile

import pytest

from libs.bus import Bus, Unavailable
from protos import subjects
from protos.messages import (
    AbortRequest,
    AckStatus,
    GenerateAck,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    RegistryEntry,
    Role,
    RouteReply,
    RouteRequest,
    ServiceState,
    TokenChunk,
    Usage,
    WireFinishReason,
    WireSamplingParams,
    WorkerLoad,
)
from services.gateway import metrics
from services.gateway.backend import BackendConfig, BackendError, NatsBackend, PeerFailed
from services.gateway.failover import Avoid, Registered, fallback_pick, too_large
from tests.fixtures.nats import start_nats_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

NS = "fo"
SAMPLING = WireSamplingParams(max_tokens=4)


def entry(instance: str, role: Role = Role.WORKER, running: int = 0, **kw) -> RegistryEntry:
    return RegistryEntry(role=role, instance_id=instance, load=WorkerLoad(running=running), **kw)


class FakeWorker:
    """A combined worker on the bus. mode: ok (4 tokens), busy (acks BUSY), silent (accepts, sends nothing),
    first_then_die (one token, then its subjects go away), first_then_move (one token, its subjects gone for 0.8 s,
    then the rest), hold (takes the request and never answers it), slow_ack (answers after 1 s), error (accepts,
    sends an error chunk), engine_dead (an error chunk saying its engine died: instance_failed), encoder_down (a
    retryable error chunk naming its code)."""

    def __init__(self, bus: Bus, instance: str, mode: str = "ok") -> None:
        self.bus, self.instance, self.mode = bus, instance, mode
        self.requests: list[str] = []
        self.resumed: list[list[int]] = []  # each request's resume_token_ids
        self.aborts: list[str] = []
        self._subs: list = []
        self._released = asyncio.Event()

    async def start(self) -> FakeWorker:
        self._subs.append(await self.bus.serve(subjects.generate(NS, self.instance), GenerateRequest, self._generate))
        self._subs.append(await self.bus.serve(subjects.health(NS, self.instance), HealthRequest, self._health))
        aborts = await self.bus.subscribe(subjects.abort(NS), AbortRequest)
        self._abort_task = asyncio.create_task(self._collect_aborts(aborts))
        return self

    async def _collect_aborts(self, sub) -> None:
        async for msg in sub:
            self.aborts.append(msg.request_id)

    async def die(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()

    async def _health(self, _: HealthRequest) -> HealthReply:
        return HealthReply(role=Role.WORKER, instance_id=self.instance, state=ServiceState.RUNNING, uptime_s=1,
                           in_flight=0)

    async def _generate(self, req: GenerateRequest) -> GenerateAck:
        self.requests.append(req.request_id)
        self.resumed.append(req.resume_token_ids)
        if self.mode == "hold":
            await self._released.wait()  # never acknowledged (the test releases it at its end, for the teardown)
        if self.mode == "slow_ack":
            await asyncio.sleep(1.0)  # five of the test backend's 0.2 s probe intervals
        if self.mode == "busy":
            return GenerateAck(request_id=req.request_id, instance_id=self.instance, status=AckStatus.BUSY,
                               message=f"{self.instance} is draining")
        if self.mode != "silent":
            asyncio.get_running_loop().call_later(0.05, lambda: asyncio.ensure_future(self._stream(req)))
        return GenerateAck(request_id=req.request_id, instance_id=self.instance)

    async def _stream(self, req: GenerateRequest) -> None:
        def chunk(**kw) -> TokenChunk:
            return TokenChunk(request_id=req.request_id, instance_id=self.instance, **kw)
        if self.mode == "error":
            await self.bus.publish(req.stream_subject,
                                   chunk(finish_reason=WireFinishReason.ERROR, error="engine broke"))
            return
        if self.mode == "engine_dead":
            await self.bus.publish(req.stream_subject, chunk(finish_reason=WireFinishReason.ERROR, instance_failed=True,
                                                             error="parallel rank 1 exited with status -9"))
            return
        if self.mode == "encoder_down":
            await self.bus.publish(req.stream_subject, chunk(finish_reason=WireFinishReason.ERROR, retryable=True,
                                                             error_code="encoder_unavailable", error="encoder gone"))
            return
        await self.bus.publish(req.stream_subject, chunk(token_ids=[1]))
        if self.mode == "first_then_die":
            await self.die()
            return
        if self.mode == "first_then_move":  # its client moves to another NATS node: its subjects gone for a while
            await self.die()
            await asyncio.sleep(0.8)
            await self.start()
        start = len(req.token_ids) + len(req.resume_token_ids)  # (as if it found all of that in its cache)
        await self.bus.publish(req.stream_subject, chunk(token_ids=[2, 3, 4], finish_reason=WireFinishReason.LENGTH,
                                                         usage=Usage(prompt_tokens=len(req.token_ids),
                                                                     completion_tokens=4, cached_tokens=start)))


def backend(bus: Bus, entries: list[RegistryEntry], **kw) -> NatsBackend:
    async def list_services() -> list[RegistryEntry]:
        return entries
    cfg = dict(liveness_interval_s=0.2, liveness_misses=2, ack_timeout_s=2, route_timeout_s=1, fleet_cache_s=0.0)
    return NatsBackend(bus, list_services, BackendConfig(**{**cfg, **kw}), namespace=NS)


async def run(b: NatsBackend, request_id: str = "req") -> list[TokenChunk]:
    return [c async for c in b.generate(request_id, [5, 6, 7], SAMPLING)]


async def test_gone_worker_is_retried_on_a_live_one(bus):
    """The registry still lists a SIGKILLed worker (no responders): the request goes to the survivor, under a new
    attempt id; the dead one is listed idle, so the fallback choice picks it first."""
    ok = await FakeWorker(bus, "w-ok").start()
    before = metrics.FAILOVERS._value.get()
    chunks = await run(backend(bus, [entry("w-dead"), entry("w-ok", running=3)]))
    assert [t for c in chunks for t in c.token_ids] == [1, 2, 3, 4]
    assert ok.requests == ["req-r1"] and metrics.FAILOVERS._value.get() == before + 1


async def test_busy_worker_is_retried_on_another(bus):
    busy = await FakeWorker(bus, "w-busy", "busy").start()
    ok = await FakeWorker(bus, "w-ok").start()
    chunks = await run(backend(bus, [entry("w-busy"), entry("w-ok", running=3)]))
    assert chunks[-1].finish_reason is WireFinishReason.LENGTH
    assert busy.requests == ["req"] and ok.requests == ["req-r1"]


async def test_worker_dying_before_the_first_chunk_is_retried_and_its_attempt_aborted(bus):
    silent = await FakeWorker(bus, "w-silent", "silent").start()
    ok = await FakeWorker(bus, "w-ok").start()
    b = backend(bus, [entry("w-silent"), entry("w-ok", running=3)])
    task = asyncio.create_task(run(b))
    async with asyncio.timeout(10):
        while not silent.requests:
            await asyncio.sleep(0.02)
    await silent.die()  # accepted, then gone: its health probes fail
    chunks = await asyncio.wait_for(task, 10)
    assert chunks[-1].finish_reason is WireFinishReason.LENGTH and ok.requests == ["req-r1"]
    async with asyncio.timeout(5):
        while "req" not in ok.aborts:  # the failed attempt was aborted downstream (every worker hears it)
            await asyncio.sleep(0.02)
    assert "req-r1" not in ok.aborts


async def test_worker_dying_after_the_first_chunk_migrates_the_stream(bus):
    """#36: the stream goes on on a live worker, which gets the tokens already sent to continue after them."""
    dying = await FakeWorker(bus, "w-dying", "first_then_die").start()
    ok = await FakeWorker(bus, "w-ok").start()
    fleet = [entry("w-dying"), entry("w-ok", running=3)]
    before = metrics.MIGRATED_PREFIX._value.get(), metrics.MIGRATED_PREFIX_LOADED._value.get()
    got = [c async for c in backend(bus, fleet).generate("req", [5, 6], SAMPLING)]
    assert [c.token_ids for c in got] == [[1], [1], [2, 3, 4]]  # (the fake ignores what it resumes from)
    assert dying.requests == ["req"] and ok.requests == ["req-r1"] and ok.resumed == [[1]]
    # the survivor loaded the prompt and the token sent (3): counted, and the client's cached tokens stay <= 2
    after = metrics.MIGRATED_PREFIX._value.get(), metrics.MIGRATED_PREFIX_LOADED._value.get()
    assert (after[0] - before[0], after[1] - before[1]) == (3, 3) and got[-1].usage.cached_tokens == 2


async def test_worker_dying_after_the_first_chunk_fails_with_503_without_migrations(bus):
    dying = await FakeWorker(bus, "w-dying", "first_then_die").start()
    ok = await FakeWorker(bus, "w-ok").start()
    got: list[TokenChunk] = []
    with pytest.raises(PeerFailed) as err:
        async for chunk in backend(bus, [entry("w-dying"), entry("w-ok", running=3)], max_migrations=0).generate(
                "req", [5], SAMPLING):
            got.append(chunk)
    assert [c.token_ids for c in got] == [[1]] and dying.requests == ["req"] and not ok.requests
    assert err.value.status == 503 and "w-dying is gone" in err.value.message and err.value.retry_after_s == 1


async def test_streaming_worker_unreachable_for_a_moment_is_not_taken_for_gone(bus):
    """A streaming worker has no responders for 0.8 s (its client moving to another node of a NATS cluster) while
    the gateway probes it every 0.2 s: four probes find nothing listening, but it is gone only once that lasted
    unreachable_grace_s (1.5 s), so the stream goes on when it is back; a worker that stays away is still gone."""
    moving = await FakeWorker(bus, "w-mover", "first_then_move").start()
    chunks = await asyncio.wait_for(run(backend(bus, [entry("w-mover")], unreachable_grace_s=1.5), "moved"), 10)
    assert [t for c in chunks for t in c.token_ids] == [1, 2, 3, 4] and moving.requests == ["moved"]
    await FakeWorker(bus, "w-dying", "first_then_die").start()
    start = asyncio.get_running_loop().time()
    with pytest.raises(PeerFailed) as err:
        await asyncio.wait_for(run(backend(bus, [entry("w-dying")], unreachable_grace_s=1.5), "died"), 10)
    assert "w-dying is gone" in err.value.message and 1.5 <= asyncio.get_running_loop().time() - start < 4


async def test_error_chunk_of_a_live_worker_is_500_and_not_retried(bus):
    broken = await FakeWorker(bus, "w-broken", "error").start()
    ok = await FakeWorker(bus, "w-ok").start()
    with pytest.raises(BackendError) as err:
        await run(backend(bus, [entry("w-broken"), entry("w-ok", running=3)]))
    assert err.value.status == 500 and "engine broke" in err.value.message
    assert broken.requests == ["req"] and not ok.requests


async def test_worker_whose_engine_died_is_treated_as_gone_and_retried(bus):
    """A live worker whose engine died (a lost parallel rank) says so in its error chunk: the request is retried on
    another worker, not answered 500."""
    dead = await FakeWorker(bus, "w-dead-engine", "engine_dead").start()
    ok = await FakeWorker(bus, "w-ok").start()
    chunks = await run(backend(bus, [entry("w-dead-engine"), entry("w-ok", running=3)]))
    assert [t for c in chunks for t in c.token_ids] == [1, 2, 3, 4]
    assert dead.requests == ["req"] and ok.requests == ["req-r1"]


async def test_retryable_error_chunk_keeps_its_code(bus):
    """A worker that could not fetch a request's image rows: 503 encoder_unavailable, not "server is at capacity"."""
    await FakeWorker(bus, "w-enc", "encoder_down").start()
    with pytest.raises(BackendError) as err:
        await run(backend(bus, [entry("w-enc")]))
    assert (err.value.status, err.value.code) == (503, "encoder_unavailable") and "encoder gone" in err.value.message


async def test_a_worker_dying_before_it_acknowledged_is_left_within_the_probes_not_the_ack_bound(bus):
    """A worker takes the request off the bus and dies before answering it: the gateway probes it beside the
    ack wait, finds nothing listening, and retries on the survivor long before ack_timeout_s (20 s here)."""
    dying = await FakeWorker(bus, "w-dying", "hold").start()
    ok = await FakeWorker(bus, "w-ok").start()
    b = backend(bus, [entry("w-dying"), entry("w-ok", running=3)], ack_timeout_s=20)

    async def die_later() -> None:
        await asyncio.wait_for(_until_requested(dying), 5)
        await dying.die()
    killer = asyncio.create_task(die_later())
    try:
        chunks = await asyncio.wait_for(run(b, "held"), 5)
        await killer
    finally:
        dying._released.set()
    assert [t for c in chunks for t in c.token_ids] == [1, 2, 3, 4]
    assert dying.requests == ["held"] and ok.requests == ["held-r1"]


async def test_a_slow_live_worker_is_waited_for_up_to_the_ack_bound(bus):
    """Probes that answer keep the wait going: a worker that acknowledges after several probe intervals serves
    the request (nothing is retried)."""
    slow = await FakeWorker(bus, "w-slow", "slow_ack").start()
    chunks = await asyncio.wait_for(run(backend(bus, [entry("w-slow")], ack_timeout_s=5), "slow"), 5)
    assert chunks[-1].finish_reason is WireFinishReason.LENGTH and slow.requests == ["slow"]


async def _until_requested(worker: FakeWorker) -> None:
    while not worker.requests:
        await asyncio.sleep(0.01)


async def test_every_worker_gone_is_503_with_retry_after(bus):
    with pytest.raises(BackendError) as err:
        await run(backend(bus, [entry("w-a"), entry("w-b", running=1)]))
    assert err.value.status == 503 and err.value.retry_after_s == 1
    assert "w-a" in err.value.message and "w-b" in err.value.message


async def test_the_only_worker_unreachable_for_a_moment_is_asked_again(bus):
    """The only listed worker has no responders at first (its client moving to another node of a NATS cluster:
    its subscriptions reach the gateway's node a moment later): with nothing else to send it to, the gateway asks
    it again within unreachable_grace_s instead of failing the request."""
    worker = FakeWorker(bus, "w-moving")
    before = metrics.REASKS._value.get()

    async def later() -> None:
        await asyncio.sleep(0.4)
        await worker.start()
    task = asyncio.create_task(later())
    chunks = await asyncio.wait_for(run(backend(bus, [entry("w-moving")]), "moving"), 5)
    await task
    assert [t for c in chunks for t in c.token_ids] == [1, 2, 3, 4]
    assert worker.requests and worker.requests[-1].startswith("moving-r") and metrics.REASKS._value.get() > before


async def test_the_only_worker_gone_fails_after_the_grace(bus):
    """Gone for good: the 503 comes once unreachable_grace_s is spent (bounded), naming the worker."""
    b = backend(bus, [entry("w-gone")], unreachable_grace_s=0.5)
    start = asyncio.get_running_loop().time()
    with pytest.raises(BackendError) as err:
        await asyncio.wait_for(run(b, "gone"), 5)
    assert err.value.status == 503 and "w-gone" in err.value.message
    assert 0.5 <= asyncio.get_running_loop().time() - start < 3


async def test_the_only_router_unreachable_for_a_moment_is_asked_again(bus):
    """A disaggregated fleet (nothing to place without a router) whose listed router has no responders at first:
    asked again within the grace, the request is served once its subscriptions are back."""
    ok = await FakeWorker(bus, "w-ok").start()
    router = FakeRouter(bus, "r-moving", "w-ok")
    entries = [entry("r-moving", Role.ROUTER), entry("p-0", Role.PREFILL), entry("d-0", Role.DECODE, address="tcp://h:1")]

    async def later() -> None:
        await asyncio.sleep(0.4)
        await router.start()
    task = asyncio.create_task(later())
    chunks = await asyncio.wait_for(run(backend(bus, entries), "three"), 5)
    await task
    assert chunks[-1].finish_reason is WireFinishReason.LENGTH and router.asked and ok.requests == ["three"]


async def test_a_router_that_ignores_exclusions_is_overridden(bus):
    """The router keeps answering the dead worker (as one that ignores exclude_instances would): the gateway
    chooses the live one from the registry."""
    asked: list[RouteRequest] = []

    async def route(req: RouteRequest) -> RouteReply:
        asked.append(req)
        return RouteReply(prefill_instance="w-dead", decode_instance="w-dead")

    await bus.serve(subjects.route(NS), RouteRequest, route)
    ok = await FakeWorker(bus, "w-ok").start()
    chunks = await run(backend(bus, [entry("w-dead"), entry("w-ok", running=3)]))
    assert chunks[-1].finish_reason is WireFinishReason.LENGTH and ok.requests == ["req-r1"]
    assert [r.exclude_instances for r in asked] == [[], ["w-dead"]]


class FakeRouter:
    """A router replica on the bus, registered by the test's listing: `answer` routes to that instance; "" refuses
    (no worker in its view); None = hung (subscribed on its own subject and in the queue group, as a SIGSTOPped
    router stays, but never answers)."""

    def __init__(self, bus: Bus, instance: str, answer: str | None) -> None:
        self.bus, self.instance, self.answer = bus, instance, answer
        self.asked: list[str] = []
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> FakeRouter:
        for subject, queue in ((subjects.router_route(NS, self.instance), None),
                               (subjects.route(NS), subjects.ROUTER_QUEUE)):
            if self.answer is None:
                sub = await self.bus.subscribe(subject, RouteRequest, queue=queue)
                self._tasks.append(asyncio.create_task(self._swallow(sub)))
            else:
                await self.bus.serve(subject, RouteRequest, self._route, queue=queue)
        return self

    async def _swallow(self, sub) -> None:
        async for req in sub:
            self.asked.append(req.request_id)

    async def _route(self, req: RouteRequest) -> RouteReply:
        self.asked.append(req.request_id)
        assert self.answer is not None
        if not self.answer:
            raise Unavailable(f"no worker for request {req.request_id}: {self.instance}'s view is empty")
        return RouteReply(prefill_instance=self.answer, decode_instance=self.answer)

    def stop(self) -> None:
        for t in self._tasks:
            t.cancel()


async def test_a_silent_router_costs_one_try_then_is_asked_last(bus):
    """Two registered routers, one hung (it holds its subscriptions but never answers, as a SIGSTOPped router or one
    behind a hung NATS node): the request it was asked first is answered by the other after one short try (not
    route_timeout_s, not a 503); later requests ask the live one first and never wait on the hung one."""
    hung = await FakeRouter(bus, "r-a", None).start()  # sorted first: asked first on the first route
    live = await FakeRouter(bus, "r-b", "w-ok").start()
    ok = await FakeWorker(bus, "w-ok").start()
    retries = metrics.ROUTE_RETRIES._value.get()
    b = backend(bus, [entry("r-a", Role.ROUTER), entry("r-b", Role.ROUTER), entry("w-ok")],
                route_timeout_s=3.0, route_try_timeout_s=0.4)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        chunks = await run(b, "first")
        took = loop.time() - started
        assert chunks[-1].finish_reason is WireFinishReason.LENGTH and ok.requests == ["first"]
        assert hung.asked == ["first"] and live.asked == ["first"], (hung.asked, live.asked)
        assert 0.4 <= took < 3.0, took  # one try on the hung router, not the whole route bound
        assert metrics.ROUTE_RETRIES._value.get() == retries + 1
        for k in range(4):  # the turn would alternate; the hung one is asked last while suspect
            await run(b, f"later{k}")
        assert hung.asked == ["first"] and live.asked == ["first"] + [f"later{k}" for k in range(4)]
    finally:
        hung.stop()


async def test_a_router_that_refuses_is_passed_over_for_one_that_places(bus):
    """A router whose view lags (just started, or resumed after a stop) answers 'no worker': the next router is
    asked; when every router refuses, the 503 carries their reason."""
    empty = await FakeRouter(bus, "r-a", "").start()
    live = await FakeRouter(bus, "r-b", "w-ok").start()
    ok = await FakeWorker(bus, "w-ok").start()
    chunks = await run(backend(bus, [entry("r-a", Role.ROUTER), entry("r-b", Role.ROUTER), entry("w-ok")]), "one")
    assert chunks[-1].finish_reason is WireFinishReason.LENGTH and ok.requests == ["one"]
    assert empty.asked == ["one"] and live.asked == ["one"]
    with pytest.raises(BackendError) as err:
        await run(backend(bus, [entry("r-a", Role.ROUTER), entry("w-ok")]), "two")
    assert err.value.status == 503 and "view is empty" in err.value.message and empty.asked == ["one", "two"]


async def test_every_router_silent_places_from_the_registry(bus):
    """Every registered router hung: within route_timeout_s the gateway places the request itself from the registry
    (a combined worker; a disaggregated pair too) instead of answering 503."""
    hung = await FakeRouter(bus, "r-a", None).start()
    ok = await FakeWorker(bus, "w-ok").start()
    bypassed = metrics.ROUTER_BYPASSED._value.get()
    b = backend(bus, [entry("r-a", Role.ROUTER), entry("w-ok")], route_timeout_s=1.0, route_try_timeout_s=0.4)
    disagg = backend(bus, [entry("r-a", Role.ROUTER), entry("p-0", Role.PREFILL),
                           entry("d-0", Role.DECODE, address="tcp://127.0.0.1:1")],
                     route_timeout_s=1.0, route_try_timeout_s=0.4)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        chunks = await run(b, "alone")
        assert chunks[-1].finish_reason is WireFinishReason.LENGTH and ok.requests == ["alone"]
        assert 1.0 <= loop.time() - started < 3.0  # the route bound, then the placement (no router answered)
        assert hung.asked[0] == "alone" and set(hung.asked) == {"alone"}  # by name, then via the queue group
        reply = await disagg.route("pair", [1, 2, 3])
        assert (reply.prefill_instance, reply.decode_instance) == ("p-0", "d-0")
        assert metrics.ROUTER_BYPASSED._value.get() == bypassed + 2
    finally:
        hung.stop()


async def test_every_router_silent_and_nothing_to_place_is_an_explicit_503(bus):
    hung = await FakeRouter(bus, "r-a", None).start()
    b = backend(bus, [entry("r-a", Role.ROUTER), entry("p-0", Role.PREFILL)], route_timeout_s=1.0,
                route_try_timeout_s=0.4)
    try:
        with pytest.raises(BackendError) as err:
            await asyncio.wait_for(run(b), 5)
        assert (err.value.status, err.value.code, err.value.retry_after_s) == (503, "router_unavailable", 1)
        assert "router did not answer" in err.value.message and "r-a" in err.value.message
        assert "decode" in err.value.message  # why nothing could be placed: no decode worker
    finally:
        hung.stop()


async def test_a_listed_router_that_is_gone_is_passed_over_at_once(bus):
    """The listing still shows a SIGKILLed router (until its entry expires): no responders on its subject, the
    next one answers; with only dead routers listed, the request is the no-router case (registry fallback)."""
    live = await FakeRouter(bus, "r-b", "w-ok").start()
    ok = await FakeWorker(bus, "w-ok").start()
    b = backend(bus, [entry("r-a", Role.ROUTER), entry("r-b", Role.ROUTER), entry("w-ok")], route_try_timeout_s=5.0)
    chunks = await asyncio.wait_for(run(b, "one"), 4)  # r-a first: no responders, no wait for its try
    assert chunks[-1].finish_reason is WireFinishReason.LENGTH and live.asked == ["one"] and ok.requests == ["one"]


async def test_only_dead_routers_listed_is_the_no_router_case(bus):
    """Every listed router gone (no responders by name or in the queue group): the registry fallback as with no
    router at all (a combined worker), and a disaggregated fleet's 503 still says to start a router."""
    ok = await FakeWorker(bus, "w-ok").start()
    chunks = await asyncio.wait_for(run(backend(bus, [entry("r-dead", Role.ROUTER), entry("w-ok")]), "two"), 4)
    assert chunks[-1].finish_reason is WireFinishReason.LENGTH and ok.requests == ["two"]
    entries = [entry("r-dead", Role.ROUTER), entry("p-0", Role.PREFILL), entry("d-0", Role.DECODE, address="tcp://h:1")]
    with pytest.raises(BackendError) as err:
        await asyncio.wait_for(run(backend(bus, entries)), 4)
    assert err.value.code == "router_unavailable" and "no router is running" in err.value.message


async def test_no_router_with_a_disaggregated_fleet_names_the_router(bus):
    entries = [entry("p-0", Role.PREFILL), entry("d-0", Role.DECODE, address="tcp://127.0.0.1:1")]
    with pytest.raises(BackendError) as err:
        await run(backend(bus, entries))
    assert err.value.status == 503 and err.value.code == "router_unavailable"
    assert "no router is running" in err.value.message and "start a router" in err.value.message
    assert "no live worker in the registry" not in err.value.message


async def test_nats_down_names_the_control_plane_not_the_worker():
    """NATS dies while a request waits for its first chunk (the worker is alive): the error names the control
    plane after the reconnect bound; so does a request sent while NATS is down, once it waited that bound."""
    nats = start_nats_server(tempfile.mkdtemp(prefix="fo-nats-"))
    bus = await Bus.connect(nats.url, name="fo", timeout=5.0)
    try:
        await FakeWorker(bus, "w-silent", "silent").start()
        b = backend(bus, [entry("w-silent")], reconnect_bound_s=1.0)
        task = asyncio.create_task(run(b))
        await asyncio.sleep(0.5)
        nats.stop()
        with pytest.raises(BackendError) as err:
            await asyncio.wait_for(task, 15)
        assert err.value.code == "control_plane_unavailable" and "NATS" in err.value.message, err.value.message
        assert "gone" not in err.value.message
        with pytest.raises(BackendError) as again:
            await asyncio.wait_for(run(b, "req2"), 15)
        assert again.value.status == 503 and again.value.code == "control_plane_unavailable"
    finally:
        nats.stop()
        await bus.close()


async def test_request_sent_while_nats_restarts_is_served_once_it_is_back():
    """NATS goes away and comes back on the same port (a restart, or this gateway's client moving to another node
    of a cluster) while a request is being routed: past the route timeout the request does not fail with
    control_plane_unavailable but waits for the reconnect (within reconnect_bound_s) and is served."""
    store = tempfile.mkdtemp(prefix="fo-nats-")
    nats = start_nats_server(store)
    bus = await Bus.connect(nats.url, name="fo", timeout=5.0)
    try:
        worker = await FakeWorker(bus, "w-ok").start()
        b = backend(bus, [entry("w-ok")], reconnect_bound_s=20.0)
        waits = metrics.CONTROL_PLANE_WAITS._value.get()
        nats.stop()
        task = asyncio.create_task(run(b, "req-back"))
        await asyncio.sleep(2.0)  # twice the route timeout
        assert not task.done()
        nats = start_nats_server(store, port=nats.port)
        chunks = await asyncio.wait_for(task, 30)
        assert [t for c in chunks for t in c.token_ids] == [1, 2, 3, 4]
        assert worker.requests == ["req-back"] and metrics.CONTROL_PLANE_WAITS._value.get() > waits
    finally:
        nats.stop()
        await bus.close()


async def test_a_hung_nats_node_at_subscribe_is_waited_out_within_the_reconnect_bound():
    """The gateway's NATS node hangs (SIGSTOP, as bench.chaos stops one) as a request subscribes to its stream:
    the subscription's flush times out (2 s); the request subscribes again and is served once the node is back
    (within reconnect_bound_s), instead of failing with FlushTimeoutError."""
    nats = start_nats_server(tempfile.mkdtemp(prefix="fo-nats-"))
    bus = await Bus.connect(nats.url, name="fo", timeout=5.0)
    try:
        worker = await FakeWorker(bus, "w-ok").start()
        b = backend(bus, [entry("w-ok")], reconnect_bound_s=20.0)
        waits = metrics.CONTROL_PLANE_WAITS._value.get()
        subscribe, resumed = bus.subscribe, []

        async def hang_then_subscribe(*args, **kw):  # the node hangs at the first subscribe, for 3 s
            if not resumed:
                nats.proc.send_signal(signal.SIGSTOP)
                resumed.append(asyncio.get_running_loop().call_later(3.0, nats.proc.send_signal, signal.SIGCONT))
            return await subscribe(*args, **kw)

        bus.subscribe = hang_then_subscribe
        try:
            chunks = await asyncio.wait_for(run(b, "req-hung"), 30)
        finally:
            nats.proc.send_signal(signal.SIGCONT)
        assert [t for c in chunks for t in c.token_ids] == [1, 2, 3, 4] and worker.requests == ["req-hung"]
        assert metrics.CONTROL_PLANE_WAITS._value.get() > waits
    finally:
        nats.stop()
        await bus.close()


async def test_too_large_for_every_worker_is_400_before_anything_is_sent(bus):
    worker = await FakeWorker(bus, "w-small").start()
    with pytest.raises(BackendError) as err:
        await run(backend(bus, [entry("w-small", max_tokens=5)]))
    assert err.value.status == 400 and "limit of 5" in err.value.message and not worker.requests


# --- pure decisions ---------------------------------------------------------------------------------


def test_too_large_needs_one_candidate_of_each_needed_role():
    fleet = Registered.of([entry("p", Role.PREFILL, max_tokens=4096),
                           entry("d-small", Role.DECODE, max_tokens=4096, max_prompt_tokens=512),
                           entry("d-big", Role.DECODE, max_tokens=8192, max_prompt_tokens=1024)], now=0)
    assert too_large(fleet, 1000, 100) is None  # d-big holds it
    reason = too_large(fleet, 2000, 100)
    assert reason is not None and "limit of 1024 prompt tokens of every live decode worker" in reason
    reason = too_large(fleet, 100, 4000)
    assert reason is not None and "4100 tokens exceeds the limit of 4096 of every live prefill worker" in reason
    assert too_large(Registered.of([], now=0), 10**6, 1) is None  # nothing registered: routing says so
    # aggregated: combined workers only; 0 = unknown limit
    assert too_large(Registered.of([entry("w", max_tokens=0)], now=0), 10**6, 1) is None


def test_stale_entries_are_not_candidates():
    stale = entry("w-old", max_tokens=10).model_copy(update={"heartbeat_at": 100.0, "ttl_s": 5})
    fleet = Registered.of([stale, entry("w-new", max_tokens=100)], now=1000.0)
    assert [e.instance_id for e in fleet.workers] == ["w-new"]


def test_the_chain_is_hashed_with_the_workers_advertised_page_size_and_seed():
    """A chain made with another page size or seed than the workers' matches nothing in the router's index."""
    labelled = entry("w").model_copy(update={"labels": {"kv_page_size": "4", "kv_hash_seed": "7"}})
    assert Registered.of([entry("bare"), labelled], now=0).hash_layout() == (4, 7)
    assert Registered.of([entry("bare")], now=0).hash_layout() is None


def test_fallback_pick_skips_failed_workers_and_names_the_cause():
    from libs.routing import LengthBuckets

    buckets = LengthBuckets(())
    fleet = Registered.of([entry("a"), entry("b", running=5)], now=0)
    assert fallback_pick(fleet, 10, buckets, "r", Avoid()) == "a"
    assert fallback_pick(fleet, 10, buckets, "r", Avoid(instances={"a"})) == "b"
    with pytest.raises(LookupError, match="besides"):
        fallback_pick(fleet, 10, buckets, "r", Avoid(instances={"a", "b"}))
    with pytest.raises(LookupError, match="no live worker in the registry"):
        fallback_pick(Registered.of([], now=0), 10, buckets, "r", Avoid())


def test_repick_avoids_failed_prefill_and_decode():
    from libs.routing import LengthBuckets
    from services.gateway.failover import repick

    fleet = Registered.of([entry("p-a", Role.PREFILL), entry("p-b", Role.PREFILL, running=4),
                           entry("d-a", Role.DECODE, address="tcp://h:1"),
                           entry("d-b", Role.DECODE, address="tcp://h:2", running=4)], now=0)
    buckets = LengthBuckets(())
    assert repick(fleet, 10, buckets, "r", Avoid()) == ("p-a", "d-a")
    assert repick(fleet, 10, buckets, "r", Avoid(instances={"p-a"}, decodes={"d-a"})) == ("p-b", "d-b")
    with pytest.raises(LookupError, match="prefill worker in the registry besides"):
        repick(fleet, 10, buckets, "r", Avoid(instances={"p-a", "p-b"}))
