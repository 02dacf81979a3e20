"""EncoderClient: the EncoderAPI over NATS (control) and the transfer engine (embedding rows).

Construction and lifecycle, as gateway and workers use it:

    client = EncoderClient(bus, namespace, view, engine=None,      # engine: a started KVTransferEngine (workers)
                           config=EncoderClientConfig(vision=model_config.vision))
    await client.start(); ...; await client.close()

- **Placement**: `encode` computes the content hash (`libs.mm.placeholders.content_hash` under `config.vision`, which
  must be the served model's: the encoder checks it) and picks the encoder by consistent hashing of it over the
  live `Role.ENCODER` entries of `view` (`libs.gcache.ring.HashRing`), so the same image meets the same cache;
  encoders joining or leaving move only the hashes they win or held.
- **Bounds**: each encode attempt waits at most `encode_timeout_s`; an encoder that is gone (no responders),
  silent (timeout) or refuses (unavailable: its cache is full of leased entries) is retried once on the next
  encoder of the ring (`retries`), then `EncoderUnavailable`; an attempt whose encoder leaves the view
  (dies: no reply will ever come) is abandoned once it has been out of the view for 10 s (a draining encoder
  leaves the view too and finishes what it took within its drain bound), not after the whole 60 s bound. A reply
  with an error (bad input) is `EncodeError` at once: another encoder would say the same.
- **Fetch** (needs `engine`): one transfer per encoder (expect, then request, then await, all within
  `fetch_timeout_s`), at most 64 hashes per request; rows arrive in the requested dtype (the encoder converts).
  An encoder that no longer holds an item, or any failure, is `EncoderUnavailable` (the request fails, or the
  caller encodes again).

`view` must hold `Role.ENCODER` entries (a view of every role, or of encoders only); the caller starts and
stops it. `connect_client` builds a standalone client with its own bus, view and engine (tools, tests, bench).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from libs.bus import Bus, BusError, Registry, RegistryView
from libs.gcache.ring import HashRing
from libs.mm import wire
from libs.mm.api import Encoded, EncodeError, EncoderMissing, EncoderUnavailable
from libs.mm.placeholders import content_hash, num_tokens
from libs.model.config import ModelConfig
from libs.model.vision_config import VisionConfig
from libs.transfer import KVTransferEngine, TransferError, TransferHeader, advertised_address, create_engine
from protos import subjects
from protos.base import ProtocolError
from protos.messages import (
    EmbedFetchReply,
    EmbedFetchRequest,
    EncodeReply,
    EncodeRequest,
    MMKind,
    Role,
    WireMMItem,
)

MAX_FETCH = 64  # hashes per EmbedFetchRequest (protos)
_RESYNC_AGE_S = 1.0  # no encoder in the view: list the registry again if the last listing is older
_GONE_POLL_S = 0.25  # an encode attempt checks this often that its encoder is still live in the view
_GONE_GRACE_S = 10.0  # ... and gives up on it once it has been out of the view this long (a draining encoder,
# out of the view too, finishes its encodes within its drain bound: DRAIN_TIMEOUT_S, 10 s by default)


def _tiny_vision() -> VisionConfig:
    vc = ModelConfig.tiny().vision
    assert vc is not None
    return vc


@dataclass(frozen=True)
class EncoderClientConfig:
    vision: VisionConfig = field(default_factory=_tiny_vision)
    """The served model's vision config (what the content hash covers); default: the built-in tiny model's."""
    encode_timeout_s: float = 60.0
    """One encode attempt (decode + preprocess + queue + tower on the encoder)."""
    fetch_timeout_s: float = 10.0
    """One fetch, every encoder of it together."""
    retries: int = 1
    """Further encoders of the ring tried when one is unavailable."""
    missing_after_s: float = 30.0
    """No encoder registered this long after the client started, nor ever since: the deployment has none
    (`EncoderMissing`); before that, or once one was seen, none live is transient (`EncoderUnavailable`)."""
    virtual_nodes: int = 64
    advertise_host: str = ""
    """Host encoders dial to send embeddings (empty: the engine's bound host, or this host's IP on 0.0.0.0)."""

    def __post_init__(self) -> None:
        if self.encode_timeout_s <= 0 or self.fetch_timeout_s <= 0 or self.retries < 0:
            raise ValueError("EncoderClientConfig: timeouts must be > 0 and retries >= 0")


class EncoderClient:
    def __init__(self, bus: Bus, namespace: str, view: RegistryView, engine: KVTransferEngine | None = None,
                 config: EncoderClientConfig | None = None) -> None:
        self.bus, self.namespace, self.view, self.engine = bus, namespace, view, engine
        self.config = config or EncoderClientConfig()
        self.vc = self.config.vision
        self._ring = HashRing(virtual_nodes=self.config.virtual_nodes)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._started = time.monotonic()
        self._seen_encoder = False

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        """Wait (bounded) for the transfer cancellations still running."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)

    # ------------------------------------------------------------------ placement

    def encoders(self) -> list[str]:
        """Live encoders (with a transfer address) in the view now."""
        return [e.instance_id for e in self.view.live(time.time(), Role.ENCODER) if e.address]

    async def candidates(self, mm_hash: int) -> list[str]:
        """The encoders to try for `mm_hash`, home first (`retries` + 1 at most)."""
        live = self.encoders()
        if not live:
            await self.view.resync_if_older(_RESYNC_AGE_S)
            live = self.encoders()
        self._seen_encoder = self._seen_encoder or bool(live)
        if set(live) != self._ring.nodes:
            self._ring = HashRing(live, virtual_nodes=self.config.virtual_nodes)
        return self._ring.successors(f"{mm_hash:016x}", self.config.retries + 1)

    # ------------------------------------------------------------------ encode

    async def encode(self, request_id: str, kind: MMKind, data: bytes) -> Encoded:
        if not data:
            raise EncodeError(f"the {kind.value} is empty")
        mm_hash, text = await off_loop(len(data), _hash_and_b64, data, kind, self.vc)
        order = await self.candidates(mm_hash)
        if not order:
            if not self._seen_encoder and time.monotonic() - self._started >= self.config.missing_after_s:
                raise EncoderMissing("this deployment runs no encoder")
            raise EncoderUnavailable("no encoder is registered")
        req = EncodeRequest(request_id=request_id, mm_hash=mm_hash, kind=kind, data_b64=text)
        failures = []
        for iid in order:
            try:
                reply = await self._ask(iid, req)
            except (BusError, ProtocolError) as exc:  # gone, silent, refusing or broken: the next one may serve
                failures.append(f"{iid}: {exc}")
                continue
            if reply is None:  # it left the registry while encoding (died): the next one may serve
                failures.append(f"{iid}: left the registry while encoding")
                continue
            if reply.error:
                raise EncodeError(reply.error)
            grid = tuple(reply.grid_thw)
            if len(grid) != 3 or reply.mm_hash != mm_hash or reply.num_tokens != num_tokens(grid, self.vc):
                failures.append(f"{iid}: inconsistent reply {reply}")
                continue
            return Encoded(mm_hash, kind, reply.num_tokens, (grid[0], grid[1], grid[2]), iid, reply.cached)
        raise EncoderUnavailable(f"no encoder served the {kind.value}: {'; '.join(failures)}")

    async def _ask(self, iid: str, req: EncodeRequest) -> EncodeReply | None:
        """One encode attempt on `iid`, bounded by `encode_timeout_s`; None once `iid` has been out of the view of
        live encoders for `_GONE_GRACE_S` (a killed encoder never answers: its request would wait the whole bound;
        a draining one leaves the view at once too, but finishes what it took within its drain bound)."""
        ask = asyncio.ensure_future(self.bus.request(subjects.encoder_encode(self.namespace, iid), req, EncodeReply,
                                                     timeout=self.config.encode_timeout_s))
        gone_since: float | None = None
        try:
            while True:
                done, _ = await asyncio.wait({ask}, timeout=_GONE_POLL_S)
                if done:
                    return ask.result()
                if iid in self.encoders():
                    gone_since = None
                elif gone_since is None:
                    gone_since = time.monotonic()
                elif time.monotonic() - gone_since >= _GONE_GRACE_S:
                    return None
        finally:
            ask.cancel()

    # ------------------------------------------------------------------ fetch

    async def fetch(self, items: Sequence[WireMMItem], dtype: torch.dtype) -> list[torch.Tensor]:
        if not items:
            return []
        if self.engine is None:
            raise RuntimeError("EncoderClient.fetch needs a transfer engine (engine=...)")
        name = wire.dtype_name(dtype)
        by_encoder: dict[str, list[int]] = {}
        for item in items:
            hashes = by_encoder.setdefault(item.encoder_instance, [])
            if item.mm_hash not in hashes:
                hashes.append(item.mm_hash)
        batches = [(iid, hs[j:j + MAX_FETCH]) for iid, hs in by_encoder.items() for j in range(0, len(hs), MAX_FETCH)]
        tasks = [asyncio.ensure_future(self._fetch_from(iid, hs, name)) for iid, hs in batches]
        try:
            async with asyncio.timeout(self.config.fetch_timeout_s):
                found = await asyncio.gather(*tasks)
        except TimeoutError:
            raise EncoderUnavailable(f"embeddings not fetched within {self.config.fetch_timeout_s:g}s") from None
        finally:
            for task in tasks:  # one encoder failed: the others' fetches are of no use any more
                task.cancel()
        rows = {(iid, h): t for (iid, hs), ts in zip(batches, found, strict=True) for h, t in zip(hs, ts, strict=True)}
        out = []
        for item in items:
            t = rows[(item.encoder_instance, item.mm_hash)]
            if t.shape[0] != item.num_tokens:
                raise EncoderUnavailable(f"encoder {item.encoder_instance} sent {t.shape[0]} rows for item "
                                         f"{item.mm_hash:016x} of {item.num_tokens} tokens")
            out.append(t)
        return out

    async def _fetch_from(self, iid: str, hashes: list[int], dtype: str) -> list[torch.Tensor]:
        assert self.engine is not None
        tid = uuid.uuid4().hex
        landing: dict[int, torch.Tensor] = {}

        def allocate(header: TransferHeader) -> list[torch.Tensor]:
            tensors = [torch.empty(spec.shape, dtype=wire.torch_dtype(spec.dtype)) for spec in header.layers]
            landing.update((spec.layer_index, t) for spec, t in zip(header.layers, tensors, strict=True))
            return tensors

        incoming = self.engine.expect(tid, allocate)
        address = advertised_address(self.engine.address, self.config.advertise_host)
        try:
            reply = await self.bus.request(
                subjects.encoder_fetch(self.namespace, iid),
                EmbedFetchRequest(transfer_id=tid, mm_hashes=hashes, address=address, dtype=dtype), EmbedFetchReply,
                timeout=self.config.fetch_timeout_s)
            missing = [f"{h:016x}" for h, s in zip(hashes, reply.sizes, strict=True) if s < 0]
            if missing:
                raise EncoderUnavailable(f"encoder {iid} no longer holds the embeddings of {', '.join(missing)}")
            await incoming.wait(timeout=self.config.fetch_timeout_s)
            assert incoming.header is not None
            wire.check_layers(incoming.header.layers, reply.sizes, reply.hidden, dtype)
            return [landing[i] for i in range(len(hashes))]
        except (BusError, ProtocolError, TransferError, ValueError) as exc:
            raise EncoderUnavailable(f"fetch from encoder {iid} failed: {exc}") from exc
        finally:
            if not incoming.state.terminal:  # nothing came (all missed) or we gave up: free the expectation
                task = asyncio.ensure_future(self.engine.cancel(tid, "embedding fetch ended"))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)


OFF_LOOP_BYTES = 256 << 10
"""Inputs at least this large are hashed and base64-coded on a thread (tens of ms for a 20 MiB file would
stall the caller's event loop); smaller ones inline (a thread hop costs more than the work)."""

T = TypeVar("T")


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a thread when `size` (bytes handled) is at least OFF_LOOP_BYTES, else inline."""
    return await asyncio.to_thread(fn, *args) if size >= OFF_LOOP_BYTES else fn(*args)


def _hash_and_b64(data: bytes, kind: MMKind, vc: VisionConfig) -> tuple[int, str]:
    return content_hash(data, kind.value, vc), base64.b64encode(data).decode()


@contextlib.asynccontextmanager
async def connect_client(nats_url: str, namespace: str, config: EncoderClientConfig | None = None,
                         min_encoders: int = 1, wait_s: float = 30.0) -> AsyncIterator[EncoderClient]:
    """A started client with its own bus, encoder view and transfer engine (`create_engine()`), once the view
    lists `min_encoders` encoders (TimeoutError after `wait_s`); everything is closed on exit."""
    bus = await Bus.connect(nats_url, name=f"encoder-client-{uuid.uuid4().hex[:8]}")
    engine = create_engine()
    view: RegistryView | None = None
    client: EncoderClient | None = None
    try:
        await engine.start()
        view = RegistryView(await Registry.open(bus, subjects.registry_bucket(namespace)), Role.ENCODER)
        await view.start()
        client = EncoderClient(bus, namespace, view, engine, config)
        await client.start()
        async with asyncio.timeout(wait_s):
            while len(client.encoders()) < min_encoders:
                await asyncio.sleep(0.02)
        yield client
    finally:
        if client is not None:
            await client.close()
        if view is not None:
            await view.stop()
        await engine.close()
        await bus.close()


__all__ = ["connect_client", "off_loop", "EncodeError", "EncoderClient", "EncoderClientConfig", "EncoderUnavailable"]
