"""Disaggregated serving end to end: gateway -> router -> prefill -> (UCX) -> decode as processes.

Real nats-server, real ucxx (tcp on loopback), the tiny model, driven with the official openai client.
The reference is the offline engine (`LLM`) with the same page layout.
"""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from libs.engine import LLM, SamplingParams
from tests.fixtures.nats import free_port
from tests.fixtures.services import ServiceGroup

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]
# The static pools (WINDSERVE_KV_ARENA=0): the metrics test counts each pool's pages (on one arena a group's
# capacity moves with the other's use) and the 8-full-page decode below is sized in static pages.
ENGINE = {"PAGE_SIZE": "4", "NUM_FULL_PAGES": "1024", "NUM_SWA_PAGES": "128", "MAX_NUM_BATCHED_TOKENS": "64",
          "BUCKET_EDGES": "[]", "MAX_NUM_SEQS": "16", "KV_ARENA": "0"}
OFFLINE = dict(page_size=4, num_full_pages=1024, num_swa_pages=128, max_num_batched_tokens=64, bucket_edges=(),
               max_num_seqs=16)
KILL_BOUND_S = 8.0  # gateway liveness: 0.5 s probes, 2 misses; generous for 2 busy cores


class Topology(ServiceGroup):
    """nats (shared fixture) + one process per service instance, in its own namespace."""

    def iid(self, role: str, index: int) -> str:
        return f"{role}-{index}"

    def start(self, instance: str, service: str, env: dict[str, str] | None = None) -> None:
        # every process serves /metrics on a port of its own (listed in its registry entry)
        super().start(instance, service, {"WINDSERVE_METRICS_PORT": str(free_port()), **(env or {})})

    def metrics(self, instance: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The instance's Prometheus samples: (name, sorted labels) -> value."""
        entry = next(e for e in self.health()["instances"] if e["instance_id"] == instance)
        with urllib.request.urlopen(entry["metrics_url"], timeout=5) as resp:
            text = resp.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def start_topology(self, spec: dict[str, int], role_env: dict[str, dict[str, str]] | None = None) -> None:
        for role, count in spec.items():
            for i in range(count):
                self.start(self.iid(role, i), role, (role_env or {}).get(role))
        self.wait_ready(90)

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=60)


def topology(nats_url: str, logs: Path) -> Topology:
    env = {"WINDSERVE_DRAIN_TIMEOUT_S": "3", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo", "UCX_LOG_LEVEL": "error"}
    env.update({f"WINDSERVE_{k}": v for k, v in ENGINE.items()})
    return Topology(nats_url, logs, env=env)


@pytest.fixture(scope="module")
def pair2(nats_server, tmp_path_factory):
    """Two prefill and two decode replicas behind one gateway and one router."""
    topo = topology(nats_server.url, tmp_path_factory.mktemp("disagg"))
    try:
        topo.start_topology({"gateway": 1, "router": 1, "prefill": 2, "decode": 2})
        yield topo
    finally:
        topo.stop()


@pytest.fixture(scope="module")
def offline():
    torch.manual_seed(0)
    return LLM(None, **OFFLINE)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=g).tolist()


async def complete_ids(client: openai.AsyncOpenAI, ids: list[int], max_tokens: int) -> list[int]:
    resp = await client.completions.create(model="windserve-tiny", prompt=ids, max_tokens=max_tokens,
                                           temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    return list(resp.choices[0].token_ids)


async def test_greedy_outputs_equal_offline_engine_with_concurrent_clients(pair2, offline):
    prompts = [prompt(i, n) for i, n in enumerate([5, 16, 37, 70, 23, 90, 41, 12])]  # window is 16 tokens
    expected = [list(o.token_ids) for o in offline.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))]
    client = pair2.client()
    got = await asyncio.gather(*(complete_ids(client, p, 12) for p in prompts))
    assert got == expected
    decodes = [i for i in pair2.health()["instances"] if i["role"] == "decode"]
    assert len(decodes) == 2 and all(d["address"].startswith("ucx://") for d in decodes)


async def test_text_streaming_stops_and_chat_match_offline(pair2, offline):
    client = pair2.client()
    # Both prompts stop on an EOS / end-of-turn token sampled on the decode side (the tiny model's choice).
    texts = ["The quick brown fox jumps over the lazy dog, again and again, until the window slides by.",
             "Once upon a time in a land far away there lived a small model"]
    for text in texts:
        want = offline.generate([text], SamplingParams(max_tokens=20))[0]
        stream = await client.completions.create(model="windserve-tiny", prompt=text, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True})
        toks, usage, finish = [], None, None
        async for ev in stream:
            for c in ev.choices:
                toks += list(getattr(c, "token_ids", None) or [])
                finish = c.finish_reason or finish
            usage = ev.usage or usage
        assert toks == list(want.token_ids) and finish == want.finish_reason == "stop"
        assert usage.prompt_tokens == len(want.prompt_token_ids) and usage.completion_tokens == len(want.token_ids)
    chat = await client.chat.completions.create(model="windserve-tiny", max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "hello there"}])
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1


async def test_follow_up_turn_is_cached_and_still_exact(pair2, offline):
    client = pair2.client()
    first = prompt(100, 48)
    out1 = await complete_ids(client, first, 8)
    second = first + out1 + prompt(101, 10)
    resp = await client.completions.create(model="windserve-tiny", prompt=second, max_tokens=8, temperature=0,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
    want = offline.generate([second], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert list(resp.choices[0].token_ids) == list(want.token_ids)


async def test_prefill_and_decode_export_the_worker_metrics(pair2):
    """The disaggregated roles export the same engine-worker metrics as the combined worker: KV pages per
    pool, tier and state, requests in the engine, prefix hits, preemptions and outcomes."""
    client = pair2.client()
    await complete_ids(client, prompt(200, 30), 4)
    await client.close()
    roles = {"prefill": [pair2.iid("prefill", i) for i in range(2)],
             "decode": [pair2.iid("decode", i) for i in range(2)]}

    def value(samples, name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    def totals() -> dict[str, float]:
        scraped = {iid: pair2.metrics(iid) for ids in roles.values() for iid in ids}
        for samples in scraped.values():
            for pool in ("full", "swa"):
                device = [value(samples, "windserve_worker_kv_pages", pool=pool, tier="device", state=state)
                          for state in ("free", "cached", "in_use")]
                assert sum(device) == int(ENGINE["NUM_FULL_PAGES" if pool == "full" else "NUM_SWA_PAGES"])
                for state in ("free", "cached", "in_use", "reserved"):
                    value(samples, "windserve_worker_kv_pages", pool=pool, tier="host", state=state)
            for state in ("running", "waiting"):
                value(samples, "windserve_worker_requests", state=state)
            for name in ("windserve_worker_prompt_tokens", "windserve_worker_prefix_hit_tokens",
                         "windserve_worker_preemptions"):
                value(samples, name)
            raw, valid = (value(samples, "windserve_worker_kv_hit_tokens", kind=k) for k in ("raw", "valid"))
            assert raw >= valid >= 0
            for reason in ("full", "swa", "swa_leaf", "lazy", "tombstone_pruned"):
                assert value(samples, "windserve_worker_kv_evictions", reason=reason) >= 0

        def total(role: str, name: str, **labels: str) -> float:
            return sum(value(scraped[iid], name, **labels) for iid in roles[role])
        return {"prefill_prompt": total("prefill", "windserve_worker_prompt_tokens"),
                "prefill_handed_off": total("prefill", "windserve_worker_requests_done", outcome="handed_off"),
                "decode_finished": total("decode", "windserve_worker_requests_done", outcome="finished"),
                "decode_accepted": total("decode", "windserve_worker_requests_done", outcome="accepted")}

    # the gauges follow the load refresh (0.2 s here): poll until this request shows on both sides
    deadline = time.monotonic() + 20
    while True:
        seen = totals()
        if all(v >= 1 for v in seen.values()) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert seen["prefill_prompt"] >= 30 and all(v >= 1 for v in seen.values()), seen


async def test_mtp_on_both_roles_equals_offline_greedy_and_decode_verifies_drafts(nats_server, tmp_path, offline):
    """WINDSERVE_SPECULATIVE_TOKENS=3 on prefill and decode processes (the draft layers' KV shipped, prefill's
    first drafts and hidden rows handed over with kv_commit): greedy outputs equal the offline engine without
    MTP, the decode worker verifies drafts (its metrics), and a sampled request is served too."""
    topo = topology(nats_server.url, tmp_path)
    mtp = {"WINDSERVE_SPECULATIVE_TOKENS": "3"}
    try:
        topo.start_topology({"gateway": 1, "router": 1, "prefill": 1, "decode": 1}, {"prefill": mtp, "decode": mtp})
        client = topo.client()
        prompts = [prompt(400 + i, n) for i, n in enumerate([5, 37, 70])]
        expected = [list(o.token_ids) for o in offline.generate(prompts, SamplingParams(max_tokens=12,
                                                                                         ignore_eos=True))]
        assert [await complete_ids(client, p, 12) for p in prompts] == expected
        resp = await client.completions.create(model="windserve-tiny", prompt=prompts[1], max_tokens=8,
                                               temperature=0.8, seed=1,
                                               extra_body={"return_token_ids": True, "ignore_eos": True})
        assert len(resp.choices[0].token_ids) == 8
        await client.close()

        def drafted() -> float:
            return topo.metrics("decode-0").get(("windserve_worker_spec_tokens", (("kind", "drafted"),)), 0.0)
        deadline = time.monotonic() + 20  # (the gauges follow the load refresh)
        while drafted() < 3 * len(prompts) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert drafted() >= 3 * len(prompts)
    finally:
        topo.stop()


async def _stream_tokens(client, ids, max_tokens, progress: dict, key: int) -> tuple[str, list[int], float]:
    toks: list[int] = []
    try:
        stream = await client.completions.create(model="windserve-tiny", prompt=ids, max_tokens=max_tokens,
                                                 temperature=0, stream=True,
                                                 extra_body={"return_token_ids": True, "ignore_eos": True})
        async for ev in stream:
            for c in ev.choices:
                toks += list(getattr(c, "token_ids", None) or [])
            progress[key] = len(toks)
        return "ok", toks, time.monotonic()
    except openai.APIError as exc:
        return f"error: {exc}", toks, time.monotonic()


async def _until(cond, timeout_s: float, why, tasks=()) -> None:
    """Poll cond; fail with why() at the deadline, or at once when one of `tasks` (streams) has ended."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        ended = [t.result() for t in tasks if t.done()]
        assert not ended and time.monotonic() < deadline, f"{why()}; ended streams: {[r for r, _, _ in ended]}"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(300)  # ~30 s on a quiet 2-core box; past 150 s when two busy loops share the cores
async def test_sigkill_decode_mid_stream_moves_its_streams_to_the_survivor(nats_server, tmp_path, offline):
    topo = topology(nats_server.url, tmp_path)
    try:
        # Either decoder can hold all four streams (admission reserves max_tokens): placement may be uneven
        # without anyone being refused. A moving stream arrives as a prompt of up to ~1,500 tokens, reserved at
        # once in both pools: hence the SWA pages too.
        topo.start_topology({"gateway": 1, "router": 1, "prefill": 1, "decode": 2},
                            {"decode": {"WINDSERVE_NUM_FULL_PAGES": "2048", "WINDSERVE_NUM_SWA_PAGES": "1024"}})
        client = topo.client()
        prompts = [prompt(200 + i, 20 + 7 * i) for i in range(4)]
        max_tokens = 1500  # long enough that no stream can finish before the kill (decode is ~3-10 ms/token)
        progress: dict[int, int] = {}
        tasks = []
        # Where the streams run, from the decoders' own load reports (refreshed every 0.2 s).
        placement: dict[str, int] = {}

        def placed(n: int) -> bool:
            placement.clear()
            placement.update({i["instance_id"]: i["load"]["running"] for i in topo.health()["instances"]
                              if i["role"] == "decode" and i.get("load")})
            return sum(placement.values()) == n
        # One by one, each sent once the decoders' load reports show the streams before it: the router then
        # sees them in the load itself, not only as its own recent picks, and spreads them over both.
        for i, p in enumerate(prompts):
            tasks.append(asyncio.create_task(_stream_tokens(client, p, max_tokens, progress, i)))
            await _until(lambda i=i: progress.get(i, 0) >= 1 and placed(i + 1), 30,
                         lambda i=i: f"stream {i} did not start on a decoder: {progress} {placement}", tasks)
            await asyncio.sleep(0.5)  # the router's view of the loads: refreshed as often as the gateway's
        await _until(lambda: min(progress.values()) >= 3, 30, lambda: f"streams stalled: {progress}", tasks)
        await _until(lambda: placed(4), 10, lambda: f"decode loads never added up to the 4 streams: {placement}",
                     tasks)
        # each decoder counted its requests' arrivals (at kv_prepare): what the router matches its picks against
        assert sum(i["load"]["arrivals"] for i in topo.health()["instances"] if i["role"] == "decode") == 4
        split = sorted(d for d, n in placement.items() if 0 < n < 4)
        assert split, f"streams not on both decoders: {placement}"
        victim, survivor = split[0], next(d for d in placement if d != split[0])
        topo.procs[victim].send_signal(signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        # #36: the killed decoder's streams moved (prefill recomputed prompt + tokens sent, the survivor goes on):
        # every stream ends well, each equal to the offline engine's uninterrupted run
        assert all(r == "ok" for r, _, _ in results), [r for r, _, _ in results]
        done = list(range(len(prompts)))
        expected = [list(o.token_ids) for o in offline.generate(prompts, SamplingParams(
            max_tokens=max_tokens, ignore_eos=True))]
        for i, want in zip(done, expected, strict=True):
            assert results[i][1] == want, i
        # the survivor freed the KV of the finished requests, and routing drops the dead decoder (registry TTL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            decodes = [i for i in topo.health()["instances"] if i["role"] == "decode"]
            if [d["instance_id"] for d in decodes] == [survivor] and decodes[0]["load"]["kv_full_used"] == 0:
                break
            await asyncio.sleep(0.2)
        assert [d["instance_id"] for d in decodes] == [survivor] and decodes[0]["load"]["kv_full_used"] == 0
        after = await complete_ids(client, prompts[done[0]], 6)
        assert after == expected[0][:6]
        await client.close()
    finally:
        topo.stop()


async def test_full_decode_worker_hands_the_request_to_another(nats_server, tmp_path, offline):
    """decode-0 is too small for any request here: when the router picks it (it is the idle one while decode-1
    streams), it answers "full" and the prefill asks the router for another decode worker; the client sees
    only a correct answer. A request no decode worker can take gets 503 with Retry-After."""
    topo = topology(nats_server.url, tmp_path)
    try:
        topo.start("gateway-0", "gateway")
        topo.start("router-0", "router")
        topo.start("prefill-0", "prefill", {"WINDSERVE_DECODE_WAIT_S": "0"})  # refuse at once, no wait for room
        topo.start("decode-0", "decode", {"WINDSERVE_NUM_FULL_PAGES": "8"})  # 32 tokens: nothing below fits
        topo.start("decode-1", "decode")
        topo.wait_ready(90)
        client = topo.client()
        progress: dict[int, int] = {}
        busy = asyncio.create_task(_stream_tokens(client, prompt(300, 20), 400, progress, 0))
        await _until(lambda: progress.get(0, 0) >= 3, 30, lambda: f"stream did not start: {progress}", [busy])

        def decode1_running() -> bool:
            loads = {i["instance_id"]: i["load"] for i in topo.health()["instances"] if i["role"] == "decode"}
            return (loads.get("decode-1") or {}).get("running", 0) == 1
        await _until(decode1_running, 10, lambda: "decode-1 never reported the stream", [busy])
        ids = prompt(301, 20)
        got = await complete_ids(client, ids, 16)  # the router prefers idle decode-0, which is full
        assert got == list(offline.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids)
        assert int((await topo.details("decode-0"))["kv_refused"]) >= 1
        assert int((await topo.details("prefill-0"))["kv_rerouted"]) >= 1
        # too big for both decoders while decode-1 streams: a retryable 503, not a worker failure
        with pytest.raises(openai.APIStatusError) as err:
            await complete_ids(client, prompt(302, 20), 3700)
        assert err.value.status_code == 503 and err.value.response.headers.get("retry-after") == "1"
        assert "capacity" in err.value.message
        result, toks, _ = await busy
        assert result == "ok" and len(toks) == 400
        await client.close()
    finally:
        topo.stop()


async def test_sigkill_prefill_mid_stream_errors_the_client_and_decode_frees(nats_server, tmp_path):
    """The prefill dies while a long prompt is computed and its KV streams out (decode holds the reservation
    and part of the KV): the client gets an explicit error within the bound, and decode frees every page
    (its transfer fails when the connection drops) and serves on with a new prefill."""
    topo = topology(nats_server.url, tmp_path)
    try:
        # 4-token chunks: a 3000-token prompt takes 750 prefill steps, over a second of prefill on a quiet box
        # (8-token chunks of 1200 took 0.3 s: too short a window to see the reservation through a 0.5 s load
        # snapshot, so the test saw it only once tokens streamed). The decode SWA pool must hold the whole prompt
        # while it arrives; decode refreshes its load every 0.1 s and is asked directly (no gateway listing).
        topo.start_topology({"gateway": 1, "router": 1, "prefill": 1, "decode": 1},
                            {"prefill": {"WINDSERVE_MAX_NUM_BATCHED_TOKENS": "4"},
                             "decode": {"WINDSERVE_NUM_SWA_PAGES": "1024", "WINDSERVE_LOAD_INTERVAL_S": "0.1"}})
        client = topo.client()
        progress: dict[int, int] = {}
        long = asyncio.create_task(_stream_tokens(client, prompt(400, 3000), 8, progress, 0))

        def decode_load() -> dict:
            return next((i.get("load") or {}) for i in topo.health()["instances"] if i["role"] == "decode")
        # the reservation is visible in decode's own load: admitted (running) and pages in use, no token yet
        deadline, held = time.monotonic() + 30, {}
        while not (held.get("running") == "1" and int(held.get("kv_full_used", "0")) > 0):
            assert not long.done() and time.monotonic() < deadline, f"decode never held the reservation: {held}"
            await asyncio.sleep(0.02)
            held = await topo.details("decode-0")
        # then half a second more: the prefill's KV segments (one per 4-token step) are streaming by then, so the
        # kill drops a transfer in flight (killed at the reservation, the gateway's cancel could come first)
        await asyncio.sleep(0.5)
        assert not progress, (progress, held)
        topo.procs["prefill-0"].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        result, toks, at = await long
        assert result.startswith("error") and not toks, result
        assert at - killed_at < KILL_BOUND_S, f"error after {at - killed_at:.1f}s: {result}"
        await _until(lambda: decode_load().get("running") == 0 and decode_load().get("kv_full_used") == 0, 10,
                     lambda: f"decode kept the dead prefill's pages: {decode_load()}")
        assert int((await topo.details("decode-0"))["kv_failures"]) == 1
        topo.procs.pop("prefill-0").wait(5)  # reaped: wait_ready fails on an exited child
        topo.start("prefill-1", "prefill")
        topo.wait_ready(90)
        ids = prompt(401, 30)
        deadline = time.monotonic() + 15  # the router drops the dead prefill once its registry entry expires
        while True:
            try:
                got = await complete_ids(client, ids, 5)
                break
            except openai.APIError:
                assert time.monotonic() < deadline, "no request served after the prefill was replaced"
                await asyncio.sleep(0.5)
        assert len(got) == 5
        await client.close()
    finally:
        topo.stop()
