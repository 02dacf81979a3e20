"""The cluster at the size where routing matters (#38): 32 timing-model engines (`WINDSERVE_ENGINE_MODE=mock`:
real scheduler, KV cache, worker and bus code, no forward) behind 2 routers and a gateway, as processes on this
2-core machine. Multi-turn conversations (each turn's prompt is the last prompt, its answer and a new message)
get their earlier turns from the prefix cache of the worker the router sends them back to; no request fails.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.fixtures.faults import MODEL, deployment, prompt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

WORKERS, CONVERSATIONS, TURNS = 32, 24, 3
MOCK = {"WINDSERVE_ENGINE_MODE": "mock", "WINDSERVE_COMPILE": "0", "WINDSERVE_MOCK_PROFILE": "tiny-cpu"}
PAGE = 4  # tests/fixtures/faults.py ENGINE_ENV
# a user's pause between turns: the worker's KV events reach both routers meanwhile (back to back, a turn could
# reach a router whose view lagged on this loaded box and go to another worker)
THINK_S = 1.0


async def turn(client: httpx.AsyncClient, url: str, ids: list[int]) -> tuple[list[int], int]:
    """One completion over token ids: (its answer's ids, cached prompt tokens)."""
    resp = await client.post(f"{url}/v1/completions", json={
        "model": MODEL, "prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return body["choices"][0]["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def conversation(client: httpx.AsyncClient, url: str, c: int) -> tuple[int, int]:
    """(cached tokens over turns 2.., what an ideal cache would have: every earlier prompt + answer, page-aligned)."""
    ids = prompt(c, 48 + c % 7)
    cached = ideal = held = 0
    for t in range(TURNS):
        answer, hit = await turn(client, url, ids)
        if t:
            cached, ideal = cached + hit, ideal + held
        held = (len(ids) + len(answer) - 1) // PAGE * PAGE  # KV of all but the answer's last token, whole pages
        ids = [*ids, *answer, *prompt(10_000 + c * 10 + t, 9)]
        await asyncio.sleep(THINK_S)
    return cached, ideal


async def test_32_mock_engines_behind_2_routers_serve_conversations_from_their_caches(nats_server, tmp_path):
    dep = deployment(nats_server.url, tmp_path, MOCK)
    try:
        await asyncio.to_thread(dep.start_all, {"gateway": 1, "router": 2, "worker": WORKERS}, None, 420)
        assert len(dep.health()["services"]["worker"]) == WORKERS
        async with httpx.AsyncClient(timeout=120) as client:
            results = await asyncio.gather(*(conversation(client, dep.url, c) for c in range(CONVERSATIONS)))
        cached, ideal = sum(r[0] for r in results), sum(r[1] for r in results)
        assert cached >= 0.9 * ideal, (cached, ideal, results)
        spread = {i for i, load in dep.loads("worker").items() if int(load.get("arrivals", 0)) > 0}
        assert len(spread) >= WORKERS // 4, spread  # the conversations went to many workers, not one
    finally:
        dep.stop()
