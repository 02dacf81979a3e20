"""The fault suite: SIGKILL of each role under concurrent streams, on real processes (nats-server, gateway,
router, prefill, decode, combined workers), through plain HTTP (tests/fixtures/faults.py).

Each case asserts what the clients see: a stream the killed worker (combined or decode) was streaming moves to a
survivor and goes on, token for token as without the fault (#36); one that cannot move ends with an explicit SSE
error event (never a hang); every other stream finishes (one before its first token is retried
on a survivor); the requests sent after the kill succeed on the survivors; no 500 anywhere; the survivors'
KV pools are back at baseline. Plus: a prompt that no decode worker can ever hold is refused with 400
(context_length_exceeded) before any prefill compute, and a dead router is named as such.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.fixtures.faults import (
    Deployment,
    FaultResult,
    complete,
    deployment,
    kill_under_load,
    migrations,
    prompt,
    stream,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

ERROR_BOUND_S = 10.0  # kill -> explicit error of a stream on the killed instance (0.5 s probes x 2; busy cores)
RECOVERY_BOUND_S = 10.0  # kill -> first later request served (typically well under 1 s: bench.faults)
HUNG_BOUND_S = 15.0  # a NATS node hung for 6 s: its clients leave it within the bus's ping bound (~3 s) or at SIGCONT


def check(result: FaultResult, may_fail: int) -> None:
    """The suite's assertions on one fault; `may_fail` = streams that cannot be saved (they had tokens)."""
    failed = [o for o in result.outcomes[:result.in_flight] if not o.ok]
    assert result.status_500 == 0, [o for o in result.outcomes if o.is_500]
    assert result.lost == 0, [o for o in failed if o.lost]
    assert len(failed) <= may_fail, (result.headline(), failed)
    for o in failed:  # explicit errors (SSE error events after the stream started), in bounded time
        assert o.status == 200 and o.code and o.tokens > 0, o
        assert o.ended_at - o.sent_at < 120 and result.error_after_s < ERROR_BOUND_S, result.headline()
    assert result.later_failed == 0 and result.recovery_s < RECOVERY_BOUND_S, \
        (result.headline(), [o for o in result.outcomes if not o.ok])


def assert_baseline(details: dict[str, dict[str, str]]) -> None:
    for instance, d in details.items():
        assert (d["running"], d["waiting"], d["kv_full_used"], d["kv_swa_used"]) == ("0", "0", "0", "0"), (instance, d)


@pytest.fixture(scope="module")
def disagg(nats_server, tmp_path_factory):
    """2 prefill + 2 decode behind one gateway and one router. The prefill computes in 16-token steps, so a
    ~400-token prompt spends a while before its first token (the window of a prefill kill)."""
    dep = deployment(nats_server.url, tmp_path_factory.mktemp("faults-disagg"))
    try:
        dep.start_all({"gateway": 1, "router": 1, "prefill": 2, "decode": 2},
                      {"prefill": {"WINDSERVE_MAX_NUM_BATCHED_TOKENS": "16"}})
        yield dep
    finally:
        dep.stop()


@pytest.fixture(scope="module")
def aggregated(nats_server, tmp_path_factory):
    dep = deployment(nats_server.url, tmp_path_factory.mktemp("faults-agg"))
    try:
        dep.start_all({"gateway": 1, "router": 1, "worker": 2})
        yield dep
    finally:
        dep.stop()


def survivors(dep: Deployment, *roles: str) -> list[str]:
    return [i for i in dep.procs if i.split("-")[0] in roles]


async def test_prompt_no_decode_can_hold_is_400_before_any_prefill(disagg):
    """Each decode reserves the whole arriving prompt at once, a full and an SWA page per prompt page: on its one
    arena (the bytes of 2048 full + 512 SWA pages of 4 tokens: 4096 units, a full page 1 unit, an SWA page 4)
    819 pages and the first token's full page fit, so a prompt over 819 x 4 = 3276 tokens can never land (on the
    static pools: over its 512 SWA pages, 2048 tokens). It used to get 503 'server is at capacity' (retry!) after
    the prefill asked the decode workers."""
    async with httpx.AsyncClient(timeout=60) as client:
        before = {i: int((await disagg.details(i))["accepted"]) for i in survivors(disagg, "prefill")}
        out = await complete(client, disagg.url, prompt(1, 3277), 4)
        assert out.status == 400 and out.code == "context_length_exceeded", out
        assert "limit of 3276 prompt tokens" in out.message
        after = {i: int((await disagg.details(i))["accepted"]) for i in before}
        assert after == before  # no prefill worker saw it
        ok = await complete(client, disagg.url, prompt(2, 2000), 4)  # below the limit: served
        assert ok.ok, ok


async def assert_equal_without_the_fault(dep: Deployment, result: FaultResult, streams: int) -> None:
    """Every stream of `kill_under_load(..., prompt_len=40, max_tokens=400)` got what the same greedy request
    gets with no fault (sent again one at a time), and the gateway moved at least one stream."""
    async with httpx.AsyncClient(timeout=60) as client:
        assert await migrations(client, dep.url) >= 1
        for k, got in enumerate(result.outcomes[:streams]):
            again = await stream(client, dep.url, prompt(k, 40 + k), 400, {}, k)
            assert again.ok and got.ids == again.ids, (k, got.ids[:8], again.ids[:8])


async def test_sigkill_decode_under_load(disagg):
    """#36: the killed decode worker's streams move (prefill recomputes the prompt and the tokens already sent,
    another decode worker continues) and equal the fault-free run."""
    result = await kill_under_load(disagg, "decode", "decode", streams=6, prompt_len=40, max_tokens=400,
                                   before_first_token=False)
    check(result, may_fail=0)
    assert result.failed == 0 and result.victim_streams >= 1, result.headline()
    await assert_equal_without_the_fault(disagg, result, 6)
    assert_baseline(await disagg.settled(survivors(disagg, "prefill", "decode")))


async def test_sigkill_prefill_before_first_tokens(disagg):
    """Prompts queued and computing on the killed prefill have sent no token: all are retried on the survivor."""
    result = await kill_under_load(disagg, "prefill", "prefill", streams=8, prompt_len=1000, max_tokens=8,
                                   before_first_token=True)
    check(result, may_fail=0)
    assert result.failed == 0 and result.in_flight >= 1 and result.retried >= 1, result.headline()
    assert_baseline(await disagg.settled(survivors(disagg, "prefill", "decode")))


async def test_router_killed_is_named_in_the_error(disagg):
    disagg.kill("router-0")
    async with httpx.AsyncClient(timeout=30) as client:
        out = await complete(client, disagg.url, prompt(3, 20), 4)
    assert out.status == 503 and out.code == "router_unavailable", out
    assert "no router is running" in out.message and "no live worker in the registry" not in out.message


async def test_sigkill_combined_worker_under_load(aggregated):
    """#36: the streams of the killed worker move to the survivor and go on: every stream gets every token, each
    equal to the same greedy request with no fault (one at a time, afterwards)."""
    result = await kill_under_load(aggregated, "worker", "worker", streams=6, prompt_len=40, max_tokens=400,
                                   before_first_token=False)
    check(result, may_fail=0)
    assert result.failed == 0 and result.victim_streams >= 1, result.headline()
    await assert_equal_without_the_fault(aggregated, result, 6)
    assert_baseline(await aggregated.settled(survivors(aggregated, "worker")))
    # the router gone too: combined workers are still served (the gateway's registry fallback)
    aggregated.kill("router-0")
    async with httpx.AsyncClient(timeout=30) as client:
        outs = await asyncio.gather(*(complete(client, aggregated.url, prompt(20 + k, 16), 4) for k in range(3)))
    assert all(o.ok for o in outs), outs


async def test_nats_node_leading_the_registry_killed_under_load(tmp_path):
    """One node of a 3-node NATS cluster dies: the one leading the registry stream, so for seconds no heartbeat
    can be written while its replicas elect a new leader. Streams go on, later requests are served (within the
    gateway's registry bound), no instance is dropped from the routers' views meanwhile."""
    from tests.fixtures.faults import kill_registry_leader_under_load, nats_cluster

    async with nats_cluster(tmp_path / "run") as sup:
        dep = deployment(sup.nats_url, tmp_path / "logs", {"WINDSERVE_NATS_REPLICAS": "3"})
        try:
            dep.start_all({"gateway": 1, "router": 1, "prefill": 1, "decode": 1})
            result = await kill_registry_leader_under_load(sup, dep, streams=6)
            later = result.probes
            check(result, may_fail=0)
            assert len(later) >= 5 and all(o.ok for o in later), [o for o in later if not o.ok]
            assert_baseline(await dep.settled([i for i in dep.procs if i.split("-")[0] in ("prefill", "decode")]))
        finally:
            dep.stop()



def check_requests(result: FaultResult, may_fail_503: bool = False) -> None:
    """A fault under a request load: no 500, none lost (hung or cut), every failure an explicit 503 with
    Retry-After semantics (`may_fail_503`) or none at all, and requests sent after the fault served."""
    outs = result.probes
    assert result.status_500 == 0 and result.lost == 0, [o for o in outs if o.is_500 or o.lost]
    failed = [o for o in outs if not o.ok]
    if may_fail_503:
        assert all(o.status == 503 for o in failed), failed
    else:
        assert not failed, (result.headline(), failed)
    assert result.in_flight >= 1 and result.recovery_s < RECOVERY_BOUND_S, result.headline()
    assert any(o.ok for o in outs[-3:]), outs[-3:]


async def test_gcache_node_killed_under_load(nats_server, tmp_path):
    """One of two GCache storage nodes dies while every request looks up L3 (shared documents: hits) and writes
    back its new pages: no request fails or hangs (its lookups become misses, the prompt is recomputed), the
    surviving node keeps taking writes (the SDK ring moved on), the workers' pools are back at baseline."""
    from tests.fixtures.faults import GCACHE_NODE_ENV, GCACHE_WORKER_ENV, kill_gcache_node_under_load

    dep = deployment(nats_server.url, tmp_path / "logs")
    try:
        dep.start_all({"cache": 2, "gateway": 1, "router": 1, "worker": 2},
                      {"cache": GCACHE_NODE_ENV, "worker": GCACHE_WORKER_ENV})
        result = await kill_gcache_node_under_load(dep, ["cache-0", "cache-1"], clients=4, load_s=10)
        print(result.headline())
        check_requests(result)
        survivor = next(n for n in ("cache-0", "cache-1") if n != result.victim)
        workers = survivors(dep, "worker")
        lookups = {w: int((await dep.details(w))["gcache_lookups"]) for w in workers}
        keys = int((await dep.details(survivor))["keys"])
        async with httpx.AsyncClient(timeout=60) as client:  # after the fault: new documents land on the survivor
            outs = [await complete(client, dep.url, prompt(70_000 + k, 64), 4) for k in range(6)]
        assert all(o.ok for o in outs), outs
        assert int((await dep.details(survivor))["keys"]) > keys
        after = {w: int((await dep.details(w))["gcache_lookups"]) for w in workers}
        assert sum(after.values()) > sum(lookups.values())
        assert_baseline(await dep.settled(workers))
    finally:
        dep.stop()


async def test_encoder_killed_under_load(nats_server, tmp_path):
    """One of two encoders dies while image chats are encoded on both: a request not yet streamed is retried on
    the live encoder or refused with an explicit 503 within the bound; none hangs, no 500; later chats are
    served by the survivor; the worker's pools are back at baseline."""
    from tests.fixtures.faults import chat_image, kill_encoder_under_load

    dep = deployment(nats_server.url, tmp_path / "logs")
    try:
        dep.start_all({"encoder": 2, "gateway": 1, "router": 1, "worker": 1})
        result = await kill_encoder_under_load(dep, clients=4, load_s=10, timeout_s=45)
        print(result.headline())
        check_requests(result, may_fail_503=True)
        async with httpx.AsyncClient(timeout=60) as client:
            outs = [await chat_image(client, dep.url, 80_000 + k) for k in range(4)]  # both ring halves
        assert all(o.ok for o in outs), outs
        assert_baseline(await dep.settled(survivors(dep, "worker")))
    finally:
        dep.stop()


async def test_the_only_gcache_node_killed_under_load(nats_server, tmp_path):
    """The only GCache storage node dies while every request looks up and writes L3: L3 is gone, not the service:
    no request fails or hangs (lookups and writes become misses and skips, prompts are recomputed), requests
    after it are served, the workers' pools are back at baseline."""
    from tests.fixtures.faults import GCACHE_NODE_ENV, GCACHE_WORKER_ENV, kill_gcache_node_under_load

    dep = deployment(nats_server.url, tmp_path / "logs")
    try:
        dep.start_all({"cache": 1, "gateway": 1, "router": 1, "worker": 2},
                      {"cache": GCACHE_NODE_ENV, "worker": GCACHE_WORKER_ENV})
        result = await kill_gcache_node_under_load(dep, ["cache-0"], clients=4, load_s=8)
        print(result.headline())
        check_requests(result)
        async with httpx.AsyncClient(timeout=60) as client:
            outs = [await complete(client, dep.url, prompt(71_000 + k, 64), 4) for k in range(4)]
        assert all(o.ok for o in outs), outs
        assert_baseline(await dep.settled(survivors(dep, "worker")))
    finally:
        dep.stop()


async def test_the_only_encoder_killed_under_load(nats_server, tmp_path):
    """The only encoder dies under image chats and text completions: every image chat ends (served, or an explicit
    503 `encoder_unavailable` within the encoder client's bound; no 500, none lost), text requests keep being
    served throughout, and the worker's pools are back at baseline."""
    from tests.fixtures.faults import chat_image, fault_under_requests

    dep = deployment(nats_server.url, tmp_path / "logs")
    try:
        dep.start_all({"encoder": 1, "gateway": 1, "router": 1, "worker": 1})

        texts, images = [], []

        async def send(client: httpx.AsyncClient, k: int):
            if k % 2:
                texts.append(await complete(client, dep.url, prompt(90_000 + k, 32), 4))
                return texts[-1]
            images.append(await chat_image(client, dep.url, 60_000 + k))
            return images[-1]

        result = await fault_under_requests(dep, "encoder", "encoder-0", lambda: dep.kill("encoder-0"), send,
                                            clients=4, load_s=10, timeout_s=45)
        print(result.headline())
        outs = result.probes
        assert result.status_500 == 0 and result.lost == 0, [o for o in outs if o.is_500 or o.lost]
        assert texts and all(o.ok for o in texts), [o for o in texts if not o.ok]
        failed = [o for o in images if not o.ok]
        assert failed and all(o.status == 503 and o.code == "encoder_unavailable" for o in failed), failed
        assert max(o.ended_at - o.sent_at for o in failed) < 20, failed
        async with httpx.AsyncClient(timeout=60) as client:
            assert (await complete(client, dep.url, prompt(91_000, 32), 4)).ok
            late = await chat_image(client, dep.url, 61_000)
        assert late.status == 503 and late.code == "encoder_unavailable", late
        assert_baseline(await dep.settled(survivors(dep, "worker")))
    finally:
        dep.stop()


async def test_nats_node_leading_the_registry_hung_under_load(tmp_path):
    """The registry leader of a 3-node cluster SIGSTOPped for 6 s (three registry TTLs; its sockets stay open,
    nothing answers), then SIGCONT: no stream fails (a worker behind the hung node is silent, not gone), no
    request is lost or gets a 500 (one whose router sits behind it may get an explicit 503 until the router's
    client leaves the node), no ghost entry (the listing is the running instances), pools back at baseline."""
    from tests.fixtures.faults import hang_registry_leader_under_load, listed_instances, nats_cluster

    async with nats_cluster(tmp_path / "run") as sup:
        dep = deployment(sup.nats_url, tmp_path / "logs", {"WINDSERVE_NATS_REPLICAS": "3"})
        try:
            dep.start_all({"gateway": 1, "router": 1, "prefill": 1, "decode": 1})
            result = await hang_registry_leader_under_load(sup, dep, streams=6)
            print(result.headline(), [round(o.ended_at - o.sent_at, 2) for o in result.probes])
            streams = result.outcomes[:result.in_flight]
            assert result.lost == 0 and result.status_500 == 0 and all(o.ok for o in streams), result.headline()
            assert result.recovery_s < HUNG_BOUND_S, result.headline()
            # a request whose router or worker sits behind the hung node until its client leaves it: an explicit
            # 503 (retry), never a 500 or a hang
            for o in result.probes + result.outcomes[result.in_flight:]:
                assert o.ok or (o.status == 503 and o.ended_at - o.sent_at < HUNG_BOUND_S), o
            failed = [(o.code, o.message[:160]) for o in result.probes if not o.ok]
            assert len(result.probes) >= 5 and len(failed) <= 4, failed
            assert await listed_instances(dep) == set(dep.procs)
            assert_baseline(await dep.settled([i for i in dep.procs if i.split("-")[0] in ("prefill", "decode")]))
        finally:
            dep.stop()


async def test_one_of_two_routers_stopped_under_load(nats_server, tmp_path):
    """One of two routers SIGSTOPped for 6 s (three registry TTLs of the suite) under 4 clients' short requests,
    then SIGCONT: its subscriptions stay with nats-server and nothing answers on them. No request fails (the
    gateway asks the other router after one short try, then asks the stopped one last), none is lost or slower
    than the route bound allows; after SIGCONT the router answers by name again and is listed, no ghost, pools at
    baseline."""
    from libs.bus import Bus
    from protos import subjects
    from protos.messages import RouteReply, RouteRequest
    from tests.fixtures.faults import listed_instances, stop_router_under_load

    dep = deployment(nats_server.url, tmp_path / "logs")
    try:
        dep.start_all({"gateway": 1, "router": 2, "prefill": 1, "decode": 1})
        result = await stop_router_under_load(dep, "router-0", stop_s=6.0, clients=4, kill_after_s=3, load_s=14)
        print(result.headline(), max(round(o.ended_at - o.sent_at, 2) for o in result.probes))
        outs = result.probes
        assert result.status_500 == 0 and result.lost == 0, [o for o in outs if o.is_500 or o.lost]
        assert all(o.ok for o in outs), [o for o in outs if not o.ok]  # not even a 503
        assert len(outs) >= 20 and result.recovery_s < RECOVERY_BOUND_S, result.headline()
        assert result.retried >= 1, result.headline()  # the stopped router was asked, and passed over
        # bounded: a route waits one try (0.75 s) per silent router, never route_timeout_s (2 s) + a 503
        assert max(o.ended_at - o.sent_at for o in result.probes) < RECOVERY_BOUND_S, result.headline()
        assert await listed_instances(dep) == set(dep.procs)
        bus = await Bus.connect(nats_server.url, name="fault-check", timeout=5)
        try:
            reply = await bus.request(subjects.router_route(dep.namespace, "router-0"),
                                      RouteRequest(request_id="after-cont", num_tokens=12), RouteReply, 10)
        finally:
            await bus.close()
        assert (reply.prefill_instance, reply.decode_instance) == ("prefill-0", "decode-0")
        async with httpx.AsyncClient(timeout=30) as client:
            outs = [await complete(client, dep.url, prompt(90_000 + k, 12), 4) for k in range(4)]
        assert all(o.ok for o in outs), outs
        assert_baseline(await dep.settled(survivors(dep, "prefill", "decode")))
    finally:
        dep.stop()
