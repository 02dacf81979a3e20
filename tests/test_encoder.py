"""The encoder tier (#16): `services/encoder` (in-process and as real processes) with `libs.mm.client.EncoderClient`
over a real nats-server and the real transfer engine (UCX over tcp on loopback).

The reference everywhere is the same tower (`build_tower`, same seed) run locally, unbatched, on the same input
through the same decode + preprocessing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from libs.mm.api import EncodeError, EncoderUnavailable
from libs.mm.client import EncoderClientConfig, connect_client
from libs.mm.image import decode_image
from libs.mm.placeholders import content_hash
from libs.mm.preprocess import preprocess
from libs.mm.video import decode_video
from libs.model.config import ModelConfig
from libs.service import load_config
from protos import subjects
from protos.messages import EncodeReply, EncodeRequest, HealthReply, HealthRequest, MMKind, Role, WireMMItem
from services.encoder.batcher import DynamicBatcher, fits, next_gap, worth_waiting
from services.encoder.cache import CacheFull, EmbeddingCache
from services.encoder.config import EncoderConfig
from services.encoder.service import EncoderService, build_tower
from tests.fixtures.gcache import UCX_ENV
from tests.fixtures.nats import free_port
from tests.fixtures.services import stop_all
from tests.fixtures.waits import until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parent.parent
VC = ModelConfig.tiny().vision
assert VC is not None
HANG = 30.0  # hang detector, far above every bound under test


@pytest.fixture(autouse=True)
def _ucx_env(monkeypatch):
    for k, v in UCX_ENV.items():
        monkeypatch.setenv(k, v)


def image(seed: int, h: int = 48, w: int = 64, ext: str = ".png") -> bytes:
    rng = np.random.default_rng(seed)
    ok, buf = cv2.imencode(ext, rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    assert ok
    return buf.tobytes()


def video(path: Path, frames: int = 6, fps: float = 4.0) -> bytes:
    """A short mp4 written with opencv: a square moving across a gradient."""
    h, w = 48, 64
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
    assert writer.isOpened()
    for i in range(frames):
        frame = np.full((h, w, 3), 40 * i % 256, np.uint8)
        frame[8:24, 4 * i:4 * i + 16] = 255
        writer.write(frame)
    writer.release()
    return path.read_bytes()


def local_rows(data: bytes) -> torch.Tensor:
    """The reference: the encoder's tower, run here, alone, on the same decode + preprocessing."""
    patches, grid = preprocess([decode_image(data, 1 << 30)], VC)
    return build_tower(VC)(patches, grid)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def item_of(enc) -> WireMMItem:
    return WireMMItem(mm_hash=enc.mm_hash, kind=enc.kind, offset=0, num_tokens=enc.num_tokens,
                      grid_thw=list(enc.grid_thw), encoder_instance=enc.encoder_instance)


# ============================================================================ pure parts


def test_cache_evicts_least_recently_used_but_never_a_leased_entry():
    now = [0.0]
    cache = EmbeddingCache(budget_bytes=3 * 400, lease_s=10.0, clock=lambda: now[0])
    rows = [torch.zeros(100, 1) for _ in range(5)]  # 400 bytes each
    for k in range(3):
        cache.put(k, rows[k], (1, 2, 2))
    with pytest.raises(CacheFull):  # every entry still leased: refused, nothing evicted
        cache.put(3, rows[3], (1, 2, 2))
    assert len(cache) == 3 and cache.used_bytes == 1200 and cache.evictions == 0
    now[0] = 5.0
    cache.get(0)  # a hit renews 0's lease to 15 and makes it most recently used
    now[0] = 12.0  # 1 and 2 are out of their leases, 0 is not
    cache.put(3, rows[3], (1, 2, 2))
    assert 1 not in cache and {0, 2, 3} <= {k for k in range(5) if k in cache}  # LRU unleased (1) went first
    cache.put(4, rows[4], (1, 2, 2))
    assert 2 not in cache and 0 in cache  # then 2; 0 is leased although older than 3
    assert cache.used_bytes == 1200 and cache.evictions == 2
    with pytest.raises(CacheFull):
        cache.put(9, torch.zeros(400, 1), (1, 2, 2))  # larger than the whole budget


def test_batch_limits():
    assert fits(0, 0, 10**6, max_items=4, max_patches=100)  # a first item always runs, whatever its size
    assert fits(3, 60, 40, 4, 100) and not fits(4, 60, 1, 4, 100) and not fits(1, 60, 41, 4, 100)


async def test_batcher_fills_batches_up_to_its_limits_with_one_call_each():
    calls: list[int] = []

    def forward(patches: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        calls.append(int(grid.shape[0]))
        return patches.reshape(-1, 4 * VC.patch_dim)[:, :8]  # one row per 4 patches (merge 2x2)

    batcher = DynamicBatcher(forward, VC, max_items=3, max_patches=40, max_wait_s=0.05)
    batcher.start()
    try:
        items = [torch.full((16, VC.patch_dim), float(i)) for i in range(5)]  # 16 patches, 4 rows each
        outs = await asyncio.wait_for(asyncio.gather(*(batcher.submit(x, (1, 4, 4)) for x in items)), HANG)
    finally:
        await batcher.close()
    assert calls == [2, 2, 1]  # 40 patches fit 2 items of 16; the last one runs alone once the wait is over
    assert [float(o[0, 0]) for o in outs] == [0.0, 1.0, 2.0, 3.0, 4.0] and all(o.shape == (4, 8) for o in outs)


def test_wait_rule_follows_the_arrival_gaps():
    assert worth_waiting(None, 0.0, 1.0)  # nothing measured yet: wait, as a plain batcher
    assert worth_waiting(10.0, 0.004, 10.005) and not worth_waiting(10.0, 0.027, 10.005)
    avg = 0.0
    for _ in range(20):  # gaps of 27 ms against a 5 ms wait: the average comes to 20 ms (capped at 4 waits)
        avg = next_gap(avg, 0.027, 0.005)
    assert avg == pytest.approx(0.020, rel=0.01)
    for _ in range(10):  # an hour idle counts as one capped gap; a burst brings the average down within a few
        avg = next_gap(avg, 3600.0 if _ == 0 else 0.0, 0.005)
    assert avg < 0.002


async def test_batcher_runs_a_lone_item_at_once_at_a_moderate_rate_and_still_batches_a_burst():
    """Items 0.4 s apart against a 0.2 s wait: once the gaps are measured each runs at once (a plain wait would
    hold each for 0.2 s); a burst afterwards still shares tower calls."""
    calls: list[int] = []

    def forward(patches: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        calls.append(int(grid.shape[0]))
        return patches.reshape(-1, 4 * VC.patch_dim)[:, :8]

    batcher = DynamicBatcher(forward, VC, max_items=8, max_patches=1 << 20, max_wait_s=0.2)
    batcher.start()
    loop = asyncio.get_running_loop()
    item = torch.zeros(16, VC.patch_dim)

    async def timed() -> float:
        t0 = loop.time()
        await batcher.submit(item, (1, 4, 4))
        return loop.time() - t0

    try:
        async with asyncio.timeout(HANG):
            tasks = []
            for _ in range(6):
                tasks.append(asyncio.ensure_future(timed()))
                await asyncio.sleep(0.4)
            spent = await asyncio.gather(*tasks)
            assert spent[0] >= 0.2 and max(spent[3:]) < 0.15, spent  # the first waited: no gap measured yet
            calls.clear()
            await asyncio.gather(*(batcher.submit(item, (1, 4, 4)) for _ in range(6)))
    finally:
        await batcher.close()
    assert sum(calls) == 6 and len(calls) < 6  # the burst shared calls


# ============================================================================ in-process encoder


@contextlib.asynccontextmanager
async def running_encoder(nats_url: str, namespace: str, **overrides) -> AsyncIterator[EncoderService]:
    cfg = load_config(EncoderConfig, env={}, nats_url=nats_url, namespace=namespace, heartbeat_interval_s=0.2,
                      registry_ttl_s=2, drain_timeout_s=3, **overrides)
    svc = EncoderService(cfg)
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop()


def encoder_client(nats_url: str, namespace: str, encoders: int = 1, **config):
    return connect_client(nats_url, namespace, EncoderClientConfig(vision=VC, **config), min_encoders=encoders,
                          wait_s=HANG)


@pytest.fixture
def ns() -> str:
    return f"enc_{uuid.uuid4().hex[:8]}"


async def test_encode_then_fetch_gives_the_towers_rows_and_a_repeat_is_a_cache_hit(nats_url, ns):
    png, jpg = image(1), image(2, 40, 90, ".jpg")
    async with running_encoder(nats_url, ns) as svc, encoder_client(nats_url, ns) as client:
        async with asyncio.timeout(HANG):
            hits, encoded = metric("windserve_encoder_encodes_total", outcome="hit"), \
                metric("windserve_encoder_encodes_total", outcome="encoded")
            first = await client.encode("r1", MMKind.IMAGE, png)
            assert not first.cached and first.encoder_instance == svc.config.instance_id
            assert first.mm_hash == content_hash(png, "image", VC)
            ref = local_rows(png)
            assert first.num_tokens == ref.shape[0] and ref.shape[1] == VC.out_hidden_size
            [rows] = await client.fetch([item_of(first)], torch.float32)
            torch.testing.assert_close(rows, ref, rtol=0, atol=1e-6)

            again = await client.encode("r2", MMKind.IMAGE, png)
            assert again.cached and again.mm_hash == first.mm_hash and again.grid_thw == first.grid_thw
            assert metric("windserve_encoder_encodes_total", outcome="hit") == hits + 1
            assert metric("windserve_encoder_encodes_total", outcome="encoded") == encoded + 1  # the tower ran once

            second = await client.encode("r3", MMKind.IMAGE, jpg)
            # two items (one twice) in one fetch, converted to bfloat16 by the encoder
            a, b, a2 = await client.fetch([item_of(first), item_of(second), item_of(first)], torch.bfloat16)
            assert a.dtype == torch.bfloat16 and torch.equal(a, ref.to(torch.bfloat16)) and torch.equal(a, a2)
            torch.testing.assert_close(b, local_rows(jpg).to(torch.bfloat16), rtol=0, atol=0)

            big = image(4, 600, 800)  # ~1.4 MB: hashed / base64-coded off the loop, the bus's large-payload path
            assert len(big) > 1 << 20
            enc = await client.encode("r4", MMKind.IMAGE, big)
            [rows] = await client.fetch([item_of(enc)], torch.float32)
            torch.testing.assert_close(rows, local_rows(big), rtol=0, atol=1e-6)

            gone = WireMMItem(**{**item_of(first).model_dump(), "mm_hash": 12345})
            with pytest.raises(EncoderUnavailable, match="no longer holds"):
                await client.fetch([gone], torch.float32)


async def test_a_video_is_sampled_encoded_and_fetched_and_a_long_one_is_refused(nats_url, ns, tmp_path):
    clip = video(tmp_path / "clip.mp4")  # 6 frames at 4 fps: 1.5 s, sampled at 2 fps -> 3 frames -> t = 2
    long = video(tmp_path / "long.mp4", frames=24)  # 6 s
    async with running_encoder(nats_url, ns, max_video_seconds=3) as svc, encoder_client(nats_url, ns) as client:
        async with asyncio.timeout(HANG):
            enc = await client.encode("v", MMKind.VIDEO, clip)
            patches, grid = preprocess([decode_video(clip, VC)], VC)
            ref = build_tower(VC)(patches, grid)
            assert enc.kind is MMKind.VIDEO and list(enc.grid_thw) == grid[0].tolist() and enc.grid_thw[0] == 2
            [rows] = await client.fetch([item_of(enc)], torch.float32)
            torch.testing.assert_close(rows, ref, rtol=0, atol=1e-6)
            with pytest.raises(EncodeError, match="over the limit of 3 s"):
                await client.encode("long", MMKind.VIDEO, long)
            assert len(svc.cache) == 1


async def test_batched_outputs_equal_unbatched_and_one_computation_per_hash(nats_url, ns):
    images = [image(10 + i, 32 + 16 * (i % 3), 48 + 16 * (i % 2)) for i in range(6)]
    async with running_encoder(nats_url, ns, max_batch_items=8, max_wait_ms=300) as svc, \
            encoder_client(nats_url, ns) as client:
        async with asyncio.timeout(HANG):
            encoded = metric("windserve_encoder_encodes_total", outcome="encoded")
            batches_before = svc.batcher.batches
            inputs = images + [images[0]] * 3  # the first image 4 times, concurrently
            got = await asyncio.gather(*(client.encode(f"r{i}", MMKind.IMAGE, d) for i, d in enumerate(inputs)))
            assert metric("windserve_encoder_encodes_total", outcome="encoded") == encoded + 6  # one per hash
            assert svc.batcher.batches - batches_before < 6  # some tower call ran several images
            rows = await client.fetch([item_of(e) for e in got], torch.float32)
    for data, r in zip(inputs, rows, strict=True):
        torch.testing.assert_close(r, local_rows(data), rtol=1e-5, atol=1e-5)


async def test_bad_input_is_an_error_reply_and_nothing_is_cached(nats_url, ns, bus):
    png = image(3)
    async with running_encoder(nats_url, ns, max_input_bytes=20_000) as svc, encoder_client(nats_url, ns) as client:
        async with asyncio.timeout(HANG):
            errors = metric("windserve_encoder_encodes_total", outcome="error")
            for bad, why in ((b"definitely not an image", "not an image"),
                             (png[: len(png) // 2], "truncated"),  # truncated
                             (b"\x89PNG" + bytes(30_000), "over the limit")):
                with pytest.raises(EncodeError, match=why):
                    await client.encode("bad", MMKind.IMAGE, bad)
            with pytest.raises(EncodeError, match="empty"):  # refused before any request
                await client.encode("bad", MMKind.IMAGE, b"")
            with pytest.raises(EncodeError, match="video could not be opened"):
                await client.encode("bad", MMKind.VIDEO, b"no video here")
            subject = subjects.encoder_encode(ns, svc.config.instance_id)
            wrong_hash = EncodeRequest(request_id="x", mm_hash=content_hash(png, "image", VC) ^ 1,
                                       data_b64=base64.b64encode(png).decode())
            not_b64 = EncodeRequest(request_id="x", mm_hash=1, data_b64="!!!!")
            for req, why in ((wrong_hash, "not the content hash"), (not_b64, "not valid base64")):
                reply = await bus.request(subject, req, EncodeReply, timeout=HANG)
                assert why in reply.error and reply.num_tokens == 0
            assert metric("windserve_encoder_encodes_total", outcome="error") == errors + 6
            assert len(svc.cache) == 0 and svc.cache.used_bytes == 0
            assert not (await client.encode("ok", MMKind.IMAGE, png)).cached  # the encoder serves on


async def test_a_budget_full_of_leased_embeddings_refuses_then_evicts_once_leases_end(nats_url, ns):
    one = local_rows(image(20)).numel() * 4  # every image(seed) of the default size has the same rows
    async with running_encoder(nats_url, ns, cache_bytes=2 * one, lease_s=1.0) as svc, \
            encoder_client(nats_url, ns) as client:
        async with asyncio.timeout(HANG):
            first = await client.encode("a", MMKind.IMAGE, image(20))
            await client.encode("b", MMKind.IMAGE, image(21))
            refused = metric("windserve_encoder_encodes_total", outcome="unavailable")
            with pytest.raises(EncoderUnavailable, match="cache full"):  # both leased: no room, nothing evicted
                await client.encode("c", MMKind.IMAGE, image(22))
            assert metric("windserve_encoder_encodes_total", outcome="unavailable") == refused + 1
            assert len(svc.cache) == 2
            await asyncio.sleep(1.2)  # the leases run out
            await client.fetch([item_of(first)], torch.float32)  # a hit: the first one is leased again
            await client.encode("c", MMKind.IMAGE, image(22))
            assert first.mm_hash in svc.cache and len(svc.cache) == 2 and svc.cache.evictions == 1  # the LRU, unleased


async def test_health_lists_the_encoder_and_a_drain_finishes_the_encode_in_flight(nats_url, ns, bus):
    async with encoder_client(nats_url, ns, encoders=0) as client:
        async with running_encoder(nats_url, ns, max_wait_ms=1000) as svc, asyncio.timeout(HANG):
            await until(lambda: bool(client.encoders()), what="the encoder in the view")
            health = await bus.request(subjects.health(ns, svc.config.instance_id), HealthRequest(), HealthReply, 5)
            assert health.role is Role.ENCODER and health.details["address"].startswith(("ucx://", "tcp://"))
            [entry] = client.view.live(time.time(), Role.ENCODER)
            assert entry.address == health.details["address"] and entry.capacity == svc.config.cache_bytes
            pending = asyncio.ensure_future(client.encode("in-flight", MMKind.IMAGE, image(40)))
            await until(lambda: svc.node.inflight_encodes == 1, what="the encode is in flight")
            await svc.stop()  # stop serving, deregister, drain: the encode (held up to 1 s by the batch wait) finishes
            enc = await pending
            assert enc.num_tokens > 0 and not enc.cached
        with pytest.raises(EncoderUnavailable):
            await client.encode("after", MMKind.IMAGE, image(41))


# ============================================================================ real processes


def start_encoder(nats_url: str, namespace: str, instance: str, logs: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {**os.environ, **UCX_ENV, "WINDSERVE_NATS_URL": nats_url, "WINDSERVE_NAMESPACE": namespace,
           "WINDSERVE_INSTANCE_ID": instance, "WINDSERVE_REGISTRY_TTL_S": "2", "WINDSERVE_HEARTBEAT_INTERVAL_S": "0.5",
           "WINDSERVE_METRICS_PORT": str(port), "PYTHONUNBUFFERED": "1"}
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{instance}.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.encoder"], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    return proc, port


def scrape(port: int, line_start: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(line_start):
                return float(line.split()[-1])
    return 0.0


async def test_encoder_processes_hash_affinity_retry_and_unavailable_when_killed(nats_url, ns, tmp_path):
    procs = {iid: start_encoder(nats_url, ns, iid, tmp_path / "logs") for iid in ("enc-a", "enc-b")}
    png = image(7)
    hit_line = 'windserve_encoder_encodes_total{outcome="hit"}'
    try:
        async with encoder_client(nats_url, ns, encoders=2, encode_timeout_s=5, fetch_timeout_s=5) as client:
            async with asyncio.timeout(HANG):
                first = await client.encode("r1", MMKind.IMAGE, png)
                home = first.encoder_instance
                other = next(i for i in procs if i != home)
                assert (await client.candidates(first.mm_hash))[0] == home
                again = await client.encode("r2", MMKind.IMAGE, png)
                assert again.cached and again.encoder_instance == home  # the same image meets the same cache
                assert scrape(procs[home][1], hit_line) == 1.0 and scrape(procs[other][1], hit_line) == 0.0
                [rows] = await client.fetch([item_of(first)], torch.float32)
                torch.testing.assert_close(rows, local_rows(png), rtol=0, atol=1e-6)

                procs[home][0].send_signal(signal.SIGKILL)
                procs[home][0].wait(10)
                # its entry is still in the view (TTL): the request finds no responder and goes to the next one
                moved = await client.encode("r3", MMKind.IMAGE, png)
                assert moved.encoder_instance == other and not moved.cached
                with pytest.raises(EncoderUnavailable):  # the rows it held are gone with it
                    await client.fetch([item_of(first)], torch.float32)

                procs[other][0].send_signal(signal.SIGKILL)
                procs[other][0].wait(10)
                with pytest.raises(EncoderUnavailable):
                    await client.encode("r4", MMKind.IMAGE, png)
                await until(lambda: not client.encoders(), what="the killed encoders leave the view")
                with pytest.raises(EncoderUnavailable, match="no encoder is registered"):
                    await client.encode("r5", MMKind.IMAGE, png)
    finally:
        stop_all(p for p, _ in procs.values())
