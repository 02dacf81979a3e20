"""Streams that survive a worker's death (#36), end to end with the official openai client and GCache on: a greedy
chat, a seeded sampled chat, a `tool_choice="required"` call and a `json_schema` answer stream concurrently; the
worker holding most of them (a combined worker of 2, or a decode worker of 2) is SIGKILLed mid-generation. Every
client gets the text (or tool-call arguments) and the usage of the same request with no fault, and the survivors'
KV pools come back to baseline. (Without GCache: tests/test_faults.py and tests/test_e2e_disagg.py.)
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.fixtures.faults import GCACHE_NODE_ENV, GCACHE_WORKER_ENV, MODEL, deployment, migrations

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WORKER_ENV = {**GCACHE_WORKER_ENV, "WINDSERVE_GCACHE_WRITEBACK_EVERY": "64",
              # a moving stream arrives as a prompt of up to ~450 tokens, reserved at once
              "WINDSERVE_NUM_FULL_PAGES": "4096", "WINDSERVE_NUM_SWA_PAGES": "1024"}
TOPOLOGIES = {"aggregated": ({"cache": 1, "gateway": 1, "router": 1, "worker": 2}, "worker"),
              "disaggregated": ({"cache": 1, "gateway": 1, "router": 1, "prefill": 1, "decode": 2}, "decode")}
LONG = {"type": "string", "minLength": 200, "maxLength": 260}
TOOL = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": LONG}, "required": ["text"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"note": LONG}, "required": ["note"], "additionalProperties": False}


def requests() -> dict[str, dict]:
    chat = {"model": MODEL, "max_tokens": 400, "stream": True, "stream_options": {"include_usage": True}}
    return {
        "greedy": {**chat, "messages": [{"role": "user", "content": "tell a long story"}], "temperature": 0,
                   "extra_body": {"ignore_eos": True}},
        "seeded": {**chat, "messages": [{"role": "user", "content": "tell another"}], "temperature": 0.9,
                   "seed": 11, "extra_body": {"ignore_eos": True}},
        "tool": {**chat, "messages": [{"role": "user", "content": "take a note"}], "temperature": 0,
                 "tools": [TOOL], "tool_choice": "required"},
        "json": {**chat, "messages": [{"role": "user", "content": "a note as JSON"}], "temperature": 0,
                 "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
    }


async def run(client: openai.AsyncOpenAI, body: dict, progress: dict[str, int], key: str) -> tuple[str, dict]:
    """The streamed answer (content, or the tool calls' arguments) and the usage of its last event."""
    text, usage = "", None
    async for event in await client.chat.completions.create(**body):
        if event.usage is not None:
            usage = event.usage.model_dump()
        for choice in event.choices:
            delta = choice.delta
            text += delta.content or "".join(c.function.arguments or "" for c in delta.tool_calls or ())
            progress[key] = progress.get(key, 0) + 1
    assert usage is not None
    return text, usage


async def moved(url: str) -> float:
    async with httpx.AsyncClient(timeout=10) as http:
        return await migrations(http, url)


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
async def test_streams_of_a_killed_worker_move_and_equal_the_fault_free_answers(nats_server, tmp_path, topology):
    spec, role = TOPOLOGIES[topology]
    dep = deployment(nats_server.url, tmp_path)
    client = None
    try:
        dep.start_all(spec, {"cache": GCACHE_NODE_ENV, "worker": WORKER_ENV, "prefill": WORKER_ENV,
                             "decode": WORKER_ENV})
        client = openai.AsyncOpenAI(base_url=f"{dep.url}/v1", api_key="none", max_retries=0, timeout=120)
        bodies = requests()
        want = {k: await run(client, b, {}, k) for k, b in bodies.items()}  # fault-free, one at a time
        json.loads(want["json"][0])
        assert json.loads(want["tool"][0])["text"]
        moved_before = await moved(dep.url)

        progress: dict[str, int] = {}
        tasks = {k: asyncio.create_task(run(client, b, progress, k)) for k, b in bodies.items()}
        async with asyncio.timeout(60):  # every stream under way, then kill the worker holding most of them
            while len(progress) < len(bodies) or min(progress.values()) < 10:
                assert not any(t.done() for t in tasks.values()), "a stream ended before the kill"
                await asyncio.sleep(0.05)
        held = {i: int(load.get("running", 0)) for i, load in dep.loads(role).items()}
        victim = max(held, key=held.get)
        assert held[victim] >= 1, held
        dep.kill(victim)
        got = {k: await asyncio.wait_for(t, 120) for k, t in tasks.items()}
        assert await moved(dep.url) - moved_before >= 1
        for k in bodies:
            assert got[k][0] == want[k][0], (k, got[k][0][:60], want[k][0][:60])
            u, w = got[k][1], want[k][1]
            assert (u["prompt_tokens"], u["completion_tokens"]) == (w["prompt_tokens"], w["completion_tokens"]), k
            assert u["prompt_tokens_details"]["cached_tokens"] <= u["prompt_tokens"]
        survivors = [i for i in dep.procs if i.rsplit("-", 1)[0] in ("worker", "prefill", "decode")]
        details = await dep.settled(survivors, timeout_s=30)
        for instance, d in details.items():
            assert (d["running"], d["kv_full_used"], d["kv_swa_used"]) == ("0", "0", "0"), (instance, d)
    finally:
        if client is not None:
            await client.close()
        dep.stop()
