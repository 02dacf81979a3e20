"""The encoder's request handlers: encode (bytes -> cached embedding) and fetch (cached rows -> a worker).

`EncoderNode` encodes an item once per content hash: a cache hit renews the entry's lease, concurrent
requests of one hash share a single computation (prep threads, then the batcher), and the rows are cached
under a lease. Bad input (not base64, over a limit, not decodable, a wrong hash) is an `EncodeReply.error`
and caches nothing; a cache whose budget is all leased answers UNAVAILABLE, so the client tries the next
encoder. A fetch sends the cached rows, in the requested dtype, as the transfer the worker expects, bounded
by `send_timeout_s`. Details: docs/multimodal.md, "Encoder service".
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import cv2
import numpy as np
import torch

from libs.bus.errors import Unavailable
from libs.mm import wire
from libs.mm.api import EncodeError
from libs.mm.client import off_loop
from libs.mm.image import decode_image
from libs.mm.placeholders import content_hash
from libs.mm.preprocess import preprocess
from libs.mm.video import decode_video
from libs.model.vision_config import VisionConfig
from libs.transfer import KVTransferEngine, TransferError
from protos.messages import EmbedFetchReply, EmbedFetchRequest, EncodeReply, EncodeRequest, MMKind
from services.encoder import metrics
from services.encoder.batcher import DynamicBatcher
from services.encoder.cache import CacheFull, EmbeddingCache, Entry
from services.encoder.config import EncoderConfig
from services.encoder.limits import check_video_seconds

log = logging.getLogger("windserve.encoder")

Spawn = Callable[[Coroutine[Any, Any, Any], str], object]


def decode_b64(text: str, max_bytes: int) -> bytes:
    """The input bytes; EncodeError when they are not base64 or over `max_bytes` (checked before decoding)."""
    if len(text) // 4 * 3 > max_bytes + 2:
        raise EncodeError(f"input of about {len(text) // 4 * 3} bytes is over the limit of {max_bytes}")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EncodeError(f"input is not valid base64: {exc}") from None
    if len(data) > max_bytes:
        raise EncodeError(f"input of {len(data)} bytes is over the limit of {max_bytes}")
    if not data:
        raise EncodeError("input is empty")
    return data


def prepare(kind: MMKind, data: bytes, vc: VisionConfig, cfg: EncoderConfig,
            device: torch.device | str) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Decode + preprocess one input (a prep thread): (patches on `device`, grid); EncodeError for bad input."""
    try:
        frames: np.ndarray
        if kind is MMKind.IMAGE:
            frames = decode_image(data, cfg.max_image_pixels)
        else:
            check_video_seconds(data, cfg.max_video_seconds)
            frames = decode_video(data, vc, workers=cfg.video_threads)
            if frames.shape[0] > cfg.max_video_frames:
                raise EncodeError(f"video of {frames.shape[0]} sampled frames is over the limit of "
                                  f"{cfg.max_video_frames}")
        patches, grid = preprocess([frames], vc, device)
    except EncodeError:
        raise
    except (ValueError, cv2.error) as exc:  # degenerate sizes (smart_resize), codec errors: the input's fault
        raise EncodeError(f"the {kind.value} could not be processed: {exc}") from None
    t, h, w = (int(v) for v in grid[0])
    return patches, (t, h, w)


class EncoderNode:
    """One encoder's handlers over its cache, batcher, prep threads and transfer engine; `spawn` runs the
    fetch transfers in the background (the service's task set, so shutdown cancels them)."""

    def __init__(self, config: EncoderConfig, vc: VisionConfig, cache: EmbeddingCache, batcher: DynamicBatcher,
                 engine: KVTransferEngine, address: str, spawn: Spawn) -> None:
        self.config, self.vc = config, vc
        self.cache, self.batcher = cache, batcher
        self.engine, self.address = engine, address
        self._spawn = spawn
        self._prep = concurrent.futures.ThreadPoolExecutor(max_workers=config.prep_threads,
                                                           thread_name_prefix="encoder-prep")
        self._inflight: dict[int, asyncio.Future[Entry]] = {}
        self.inflight_fetches = 0
        self.encode_hits = 0  # encodes answered from the cache (health details)
        self._evictions_seen = 0

    def close(self) -> None:
        self._prep.shutdown(wait=False, cancel_futures=True)

    @property
    def inflight_encodes(self) -> int:
        """Hashes being computed (decode, preprocessing, queue or tower)."""
        return len(self._inflight)

    # ------------------------------------------------------------------ encode

    async def encode(self, req: EncodeRequest) -> EncodeReply:
        started = time.perf_counter()
        outcome = "internal"  # the tower or the batcher failed: the bus answers INTERNAL, the client tries another
        try:
            entry, outcome = await self._encode(req)
            return EncodeReply(mm_hash=req.mm_hash, num_tokens=entry.rows.shape[0], grid_thw=list(entry.grid),
                               cached=outcome != "encoded", lease_s=self.cache.lease_s)
        except EncodeError as exc:
            outcome = "error"
            return EncodeReply(mm_hash=req.mm_hash, error=str(exc))
        except CacheFull as exc:
            outcome = "unavailable"
            raise Unavailable(str(exc)) from None
        finally:
            metrics.ENCODES.labels(outcome).inc()
            metrics.ENCODE_SECONDS.labels(outcome).observe(time.perf_counter() - started)

    async def _encode(self, req: EncodeRequest) -> tuple[Entry, str]:
        data = await off_loop(len(req.data_b64), self._verified, req)
        entry = self.cache.get(req.mm_hash)
        metrics.CACHE.labels("encode", "miss" if entry is None else "hit").inc()
        if entry is not None:
            self.encode_hits += 1
            return entry, "hit"
        flight = self._inflight.get(req.mm_hash)
        joined = flight is not None
        if flight is None:
            flight = asyncio.ensure_future(self._compute(req.mm_hash, req.kind, data))
            self._inflight[req.mm_hash] = flight
            flight.add_done_callback(lambda _: self._inflight.pop(req.mm_hash, None))
        # shielded: a caller that gives up (drain timeout) must not cancel the others' computation
        return await asyncio.shield(flight), "joined" if joined else "encoded"

    def _verified(self, req: EncodeRequest) -> bytes:
        data = decode_b64(req.data_b64, self.config.max_input_bytes)
        if content_hash(data, req.kind.value, self.vc) != req.mm_hash:
            raise EncodeError("mm_hash is not the content hash of the data under this encoder's preprocessing "
                              "(libs.mm.placeholders.content_hash)")
        return data

    async def _compute(self, mm_hash: int, kind: MMKind, data: bytes) -> Entry:
        loop = asyncio.get_running_loop()
        patches, grid = await loop.run_in_executor(self._prep, prepare, kind, data, self.vc, self.config,
                                                   self.config.encoder_device)
        rows = await self.batcher.submit(patches, grid)
        entry = self.cache.put(mm_hash, rows, grid)
        self.export_metrics(leased=False)
        return entry

    # ------------------------------------------------------------------ fetch

    async def fetch(self, req: EmbedFetchRequest) -> EmbedFetchReply:
        dtype = wire.torch_dtype(req.dtype)  # ValueError: the caller's bug, answered as an error reply
        entries = [self.cache.get(h) for h in req.mm_hashes]
        hidden = self.vc.out_hidden_size
        sizes = [-1 if e is None else wire.nbytes(e.rows.shape[0], hidden, req.dtype) for e in entries]
        hits = sum(e is not None for e in entries)
        metrics.CACHE.labels("fetch", "hit").inc(hits)
        metrics.CACHE.labels("fetch", "miss").inc(len(entries) - hits)
        found = [(i, e.rows) for i, e in enumerate(entries) if e is not None]
        if found:
            self.inflight_fetches += 1
            self._spawn(self._send(req, found, dtype), f"fetch-{req.transfer_id}")
        return EmbedFetchReply(sizes=sizes, hidden=hidden)

    async def _send(self, req: EmbedFetchRequest, found: list[tuple[int, torch.Tensor]], dtype: torch.dtype) -> None:
        # The rows are held here: an eviction meanwhile drops the cache's reference, never these bytes.
        specs = [wire.layer_spec(i, rows.shape[0], rows.shape[1], req.dtype) for i, rows in found]
        payloads = [rows.to(dtype).contiguous() for _, rows in found]
        try:
            async with asyncio.timeout(self.config.send_timeout_s):
                stats = await self.engine.send(req.address, req.transfer_id, specs, payloads)
            metrics.FETCH_BYTES.inc(stats.nbytes)
        except (TransferError, TimeoutError, OSError, ValueError) as exc:  # the worker left, or is too slow
            metrics.SEND_FAILURES.inc()
            log.info("fetch transfer failed", extra={"transfer_id": req.transfer_id, "error": repr(exc)})
        finally:
            self.inflight_fetches -= 1

    # ------------------------------------------------------------------ upkeep

    def export_metrics(self, leased: bool = True) -> None:
        """Refresh the cache gauges; `leased` walks every entry, so an encode leaves it to the upkeep loop (per
        encode, it was a fifth of the service loop's time at saturation with a few thousand entries cached)."""
        metrics.CACHE_BYTES.labels("used").set(self.cache.used_bytes)
        if leased:
            metrics.CACHE_BYTES.labels("leased").set(self.cache.leased_bytes())
        metrics.CACHE_BYTES.labels("budget").set(self.cache.budget_bytes)
        metrics.CACHE_ENTRIES.set(len(self.cache))
        metrics.EVICTIONS.inc(self.cache.evictions - self._evictions_seen)
        self._evictions_seen = self.cache.evictions

    def details(self) -> dict[str, str]:
        return {"address": self.address, "entries": str(len(self.cache)), "cache_hits": str(self.encode_hits),
                "cache_used": str(self.cache.used_bytes),
                "cache_budget": str(self.cache.budget_bytes), "evictions": str(self.cache.evictions),
                "refusals": str(self.cache.refusals), "inflight_encodes": str(self.inflight_encodes),
                "queued": str(self.batcher.queued), "batches": str(self.batcher.batches),
                "batched_items": str(self.batcher.items), "inflight_fetches": str(self.inflight_fetches)}
