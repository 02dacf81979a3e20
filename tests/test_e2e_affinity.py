"""KV-affinity routing end to end (#11): real nats-server, gateway, router(s) and workers as processes with
the tiny model, 12 multi-turn chat sessions sent turn by turn through the `openai` client.

The reference is one worker serving the same sessions alone: its cached share of the follow-up prompt
tokens (`usage.prompt_tokens_details.cached_tokens`) is what a cluster would give if every turn found its
cache. A cluster behind the KV-affinity router must keep at least 0.9 of it, while no worker serves more
than 1.5x the mean number of requests (aggregated with one router, with two router replicas, and
disaggregated with 2 prefill + 2 decode workers).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator

import openai
import pytest

from tests.fixtures.services import ServiceGroup, start_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SESSIONS, TURNS = 12, 4
ENGINE = {"WINDSERVE_PAGE_SIZE": "16", "WINDSERVE_NUM_FULL_PAGES": "1024", "WINDSERVE_NUM_SWA_PAGES": "512",
          "WINDSERVE_BUCKET_EDGES": "[]"}
MIN_SHARE_OF_ONE_WORKER = 0.9
LOAD_INTERVAL_S = 0.5  # the workers' load snapshot period (WorkerConfig.load_interval_s's default)
MAX_REQUESTS_OVER_MEAN = 1.5


def session_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


async def run_sessions(url: str, think: Callable[[], Awaitable[None]]) -> tuple[int, int]:
    """Send SESSIONS chats turn by turn (each turn of every session concurrently, then, after `think`, the next
    turn: a follow-up repeats the whole conversation so far). Returns (cached, prompt) tokens of the
    follow-ups."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    rng = random.Random(11)
    convs = [[{"role": "system", "content": f"You are agent {s}. " + session_text(rng, 300)}] for s in range(SESSIONS)]
    cached = prompt = 0

    async def turn(conv: list[dict[str, str]], t: int) -> tuple[int, int]:
        conv.append({"role": "user", "content": session_text(rng, 60)})
        resp = await client.chat.completions.create(model="windserve-tiny", messages=conv, max_tokens=12,
                                                    temperature=0, seed=t)
        conv.append({"role": "assistant", "content": resp.choices[0].message.content or ""})
        usage = resp.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return usage.prompt_tokens_details.cached_tokens or 0, usage.prompt_tokens

    try:
        for t in range(TURNS):
            if t:
                await think()
            results = await asyncio.gather(*(turn(c, t) for c in convs))
            if t:
                cached += sum(r[0] for r in results)
                prompt += sum(r[1] for r in results)
    finally:
        await client.close()
    return cached, prompt


def deploy(nats_url: str, logs, services: dict[str, str]) -> ServiceGroup:
    return start_group(nats_url, logs, services, {"WINDSERVE_LOG_LEVEL": "WARNING", "UCX_TLS": "tcp,self",
                                                  "UCX_NET_DEVICES": "lo", "UCX_LOG_LEVEL": "error", **ENGINE})


async def wait_indexed(group: ServiceGroup, routers: list[str], workers: int, timeout: float = 60.0) -> None:
    """Until every router's prefix index holds all `workers` with none stale: a router whose snapshot of a
    worker is still pending (a startup on a busy machine retries with backoff) predicts no hit there, and its
    follow-ups would measure the resync, not the routing."""
    deadline = time.monotonic() + timeout
    details: dict[str, dict[str, str]] = {}
    while time.monotonic() < deadline:
        details = {r: await group.details(r) for r in routers}
        if all(d.get("kv_workers") == str(workers) and d.get("kv_stale") == "0" for d in details.values()):
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"routers' indexes not in sync with {workers} workers within {timeout}s: {details}")


def thinking(group: ServiceGroup, workers: list[str], timeout: float = 30.0) -> Callable[[], Awaitable[None]]:
    """The users' think time between turns: until every worker's load snapshot shows the last turn finished,
    then time for the registry to carry it (the routers read running requests from there). Without it a turn
    started within milliseconds of the last one's answers, and on a busy box the routers could still see the
    last turn's requests running on the workers that hold the sessions: the cost's running-request term
    (64 prefill tokens each) of a burst can outweigh a hit of a few hundred tokens, which moves a session for a
    stale load, not for affinity. Real users' follow-ups come seconds apart."""
    async def think() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            loads = [await group.details(w) for w in workers]
            if all(d.get("running") == "0" and d.get("waiting") == "0" for d in loads):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(2 * LOAD_INTERVAL_S)
    return think


async def served(group: ServiceGroup, instances: list[str]) -> dict[str, int]:
    return {i: int((await group.details(i))["accepted"]) for i in instances}


@pytest.fixture(scope="module")
def one_worker_share(nats_server, tmp_path_factory) -> Iterator[float]:
    group = deploy(nats_server.url, tmp_path_factory.mktemp("aff-one"),
                   {"gw": "gateway", "router": "router", "w0": "worker"})
    try:
        asyncio.run(wait_indexed(group, ["router"], 1))
        cached, prompt = asyncio.run(run_sessions(group.url, thinking(group, ["w0"])))
    finally:
        group.stop()
    assert cached > 0.3 * prompt, (cached, prompt)  # the reference itself reuses most of each conversation
    yield cached / prompt


async def serve_and_check(nats_url: str, logs, services: dict[str, str], counted: list[str], one_worker_share: float,
                          label: str) -> None:
    """Run the sessions on `services`; check the cached share against one worker's and the requests per
    instance of `counted` (every request is counted once there) against their mean."""
    group = deploy(nats_url, logs, services)
    routers = [i for i, s in services.items() if s == "router"]
    try:
        await wait_indexed(group, routers, len([s for s in services.values() if s != "gateway" and s != "router"]))
        engines = [i for i, s in services.items() if s not in ("gateway", "router")]
        cached, prompt = await run_sessions(group.url, thinking(group, engines))
        counts = await served(group, counted)
        indexed = {r: await group.details(r) for r in routers}  # printed with a failure: stale views, gaps
    finally:
        group.stop()
    print(f"\naffinity e2e, {label}: cached share {cached / prompt:.3f} (one worker {one_worker_share:.3f}), "
          f"requests per instance {counts}")
    assert cached / prompt >= MIN_SHARE_OF_ONE_WORKER * one_worker_share, (cached, prompt, one_worker_share, indexed)
    mean = sum(counts.values()) / len(counts)
    assert sum(counts.values()) == SESSIONS * TURNS and max(counts.values()) <= MAX_REQUESTS_OVER_MEAN * mean, counts


@pytest.mark.parametrize("routers", [1, 2])
async def test_four_workers_keep_one_workers_hits_and_share_the_load(nats_server, tmp_path, one_worker_share,
                                                                     routers):
    workers = [f"w{i}" for i in range(4)]
    services = {"gw": "gateway", **{f"router{r}": "router" for r in range(routers)}, **{w: "worker" for w in workers}}
    await serve_and_check(nats_server.url, tmp_path, services, workers, one_worker_share,
                          f"4 workers, {routers} router(s)")


async def test_disaggregated_pairs_keep_one_workers_hits(nats_server, tmp_path, one_worker_share):
    prefills = ["p0", "p1"]
    services = {"gw": "gateway", "router": "router", **{p: "prefill" for p in prefills},
                "d0": "decode", "d1": "decode"}
    await serve_and_check(nats_server.url, tmp_path, services, prefills, one_worker_share, "2 prefill + 2 decode")
