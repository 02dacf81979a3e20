"""GCache (L3) end to end (#12): real nats-server, gateway, router, 2 prefill, 2 decode and 2 storage nodes as
processes with the tiny model; every engine role with WINDSERVE_GCACHE=1.

A conversation's turns are token-id prompts (the completions API with `return_token_ids`), so the second
turn repeats the first turn's prompt and output tokens exactly (the tiny model's random output does not survive
a text round trip). The second turn is sent after the prefill worker that served the first turn has gone, so
the other prefill worker (its own caches empty) can only find the first turn's KV in GCache: its
`cached_tokens` must cover the first turn's prompt + output, page aligned. The greedy output of that turn
must equal a cache-disabled worker's (the reference).
"""

from __future__ import annotations

import asyncio
import random
import time

import openai
import pytest

from tests.fixtures.services import ServiceGroup, start_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PAGE = 16
ENGINE = {"WINDSERVE_PAGE_SIZE": str(PAGE), "WINDSERVE_NUM_FULL_PAGES": "512", "WINDSERVE_NUM_SWA_PAGES": "256",
          "WINDSERVE_BUCKET_EDGES": "[]"}
COMMON = {"WINDSERVE_LOG_LEVEL": "WARNING", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo", "UCX_LOG_LEVEL": "error"}


def start(nats_url: str, logs, services: dict[str, str], env: dict[str, str]) -> ServiceGroup:
    return start_group(nats_url, logs, services, {**COMMON, **env})


async def complete(url: str, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy completion of a token-id prompt: (output token ids, cached prompt tokens)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        resp = await client.completions.create(model="windserve-tiny", prompt=prompt, max_tokens=24, temperature=0,
                                               extra_body={"return_token_ids": True})
    finally:
        await client.close()
    usage = resp.usage
    assert usage is not None and usage.prompt_tokens == len(prompt)
    out = resp.choices[0].model_dump()["token_ids"]
    assert usage.completion_tokens == len(out)
    return out, (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0


async def stored_keys(group: ServiceGroup, nodes: list[str]) -> int:
    return sum([int((await group.details(n)).get("keys", 0)) for n in nodes])


async def test_second_turn_on_the_other_prefill_hits_gcache(nats_server, tmp_path):
    prefills, nodes = ["p0", "p1"], ["c0", "c1"]
    services = {"gw": "gateway", "router": "router", **{p: "prefill" for p in prefills}, "d0": "decode",
                "d1": "decode", **{c: "cache" for c in nodes}}
    group = start(nats_server.url, tmp_path / "gcache", services, {**ENGINE, "WINDSERVE_GCACHE": "1",
                                                                    "WINDSERVE_MEMORY_BYTES": str(256 << 20)})
    try:
        rng = random.Random(5)
        prompt1 = [rng.randrange(32, 400) for _ in range(770)]
        out1, _ = await complete(group.url, prompt1)
        served = {p: int((await group.details(p))["accepted"]) for p in prefills}
        first = max(served, key=lambda p: served[p])
        assert sorted(served.values()) == [0, 1], served
        want = (len(prompt1) + len(out1)) // PAGE * PAGE
        # write-back is asynchronous: wait (bounded) until the nodes hold every full block and a checkpoint
        deadline = time.monotonic() + 30
        while await stored_keys(group, nodes) < want // PAGE + 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert await stored_keys(group, nodes) >= want // PAGE + 1
        group.procs[first].terminate()
        group.procs[first].wait(20)
        deadline = time.monotonic() + 30
        while first in {i for ids in group.health()["services"].values() for i in ids}:
            assert time.monotonic() < deadline, "the stopped prefill stays listed"
            await asyncio.sleep(0.2)
        prompt2 = prompt1 + out1 + [rng.randrange(32, 400) for _ in range(40)]  # the next turn: all of turn 1 + more
        out2, cached2 = await complete(group.url, prompt2)
    finally:
        group.stop()
    print(f"\ngcache e2e: turn 1 prompt {len(prompt1)} + output {len(out1)}; turn 2 prompt {len(prompt2)}, "
          f"cached {cached2} (want >= {want})")
    assert cached2 >= want, (cached2, want)

    ref = start(nats_server.url, tmp_path / "ref", {"gw": "gateway", "router": "router", "w": "worker"},
                {**ENGINE, "WINDSERVE_ENABLE_PREFIX_CACHE": "0"})
    try:
        ref_out, ref_cached = await complete(ref.url, prompt2)
    finally:
        ref.stop()
    assert ref_cached == 0
    assert out2 == ref_out
