"""The SLA planner end to end (#38) and the scale-down it relies on, with timing-model engines (real scheduler, KV
cache, worker, bus and gateway; no forward).

- A worker told to stop (SIGTERM, as the planner's scale-down does) while a stream runs past its drain bound ends
  that stream as its own failure, and the gateway moves it to a live worker: the client gets every token, equal
  to the stream with no stop.
- `bench.planner --quick` against `make run` with a planner: the workers follow a ramp up and back down, no
  request fails across the scale-downs, and each ramp phase turns direction at most once. (Its SLA and
  instance-seconds figures are the benchmark's to report, not asserted here: they are timings.)
"""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from bench import planner as bench_planner
from libs.engine.mock_profile import MockProfile
from tests.fixtures.faults import MODEL, deployment, migrations, prompt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

SLOW = {"WINDSERVE_ENGINE_MODE": "mock", "WINDSERVE_COMPILE": "0"}  # the profile: per test (a file)


async def completion(client: httpx.AsyncClient, url: str, ids: list[int], n: int, started: asyncio.Event) -> list[int]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    out: list[int] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    out += choice.get("token_ids") or []
                if out:
                    started.set()
    return out


async def test_a_stream_past_the_drain_bound_moves_to_a_live_worker(nats_server, tmp_path):
    profile = tmp_path / "slow.json"
    MockProfile(fixed_s=0.05, per_token_s=0.0, per_pair_s=0.0).save(profile)  # 20 tokens/s
    dep = deployment(nats_server.url, tmp_path, {**SLOW, "WINDSERVE_MOCK_PROFILE": str(profile),
                                                 "WINDSERVE_DRAIN_TIMEOUT_S": "1"})
    try:
        await asyncio.to_thread(dep.start_all, {"gateway": 1, "router": 1, "worker": 2}, None, 180)
        ids = prompt(5, 40)
        async with httpx.AsyncClient(timeout=120) as client:
            want = await completion(client, dep.url, ids, 120, asyncio.Event())  # ~6 s, no stop
            before = await migrations(client, dep.url)
            started = asyncio.Event()
            task = asyncio.create_task(completion(client, dep.url, ids, 120, started))
            await asyncio.wait_for(started.wait(), 30)
            running = {i: (await dep.details(i)).get("in_flight_requests") for i in ("worker-0", "worker-1")}
            name = next(i for i, n in running.items() if n == "1")  # (asked live: the one holding the stream)
            dep.procs[name].send_signal(signal.SIGTERM)  # drains 1 s, then cuts the stream: it must move
            got = await asyncio.wait_for(task, 60)
            assert got == want
            assert await migrations(client, dep.url) - before >= 1
            assert dep.procs[name].wait(30) == 0  # a clean exit, not a crash
    finally:
        dep.stop()


def test_the_planner_follows_a_ramp_and_scales_down_without_failing_a_request(tmp_path):
    out = tmp_path / "planner.json"
    assert bench_planner.main(["--quick", "--out", str(out), "--run-dir", str(tmp_path / "run")]) == 0
    result = json.loads(out.read_text())
    assert all(k in result for k in bench_planner.HEADLINE_KEYS), result.keys()
    assert result["requests_failed"] == 0, result["errors"]
    counts = [n for _, n in result["workers_over_time"]]
    assert result["peak_workers"] >= 2, counts  # it scaled up under the ramp ...
    assert counts[-1] < result["peak_workers"], counts  # ... and back down in the tail
    assert all(v <= 1 for v in result["direction_changes"].values()), result["direction_changes"]
    assert out.with_suffix(".png").exists()
