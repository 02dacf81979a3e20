"""The engine-worker service base: what the combined worker, prefill and decode services share.

`EngineWorkerService` (one engine: the combined worker) and `DisaggWorkerService` (plus a KV transfer engine
advertised in the registry: prefill and decode). A role subclass sets `role` (and `core_class`), builds its
handler in `setup_role()` and serves its subject; this base builds the engine on a thread (health answers
while a checkpoint loads), subscribes to aborts and serves `stream_replay` before the role serves anything,
runs the GCache link when enabled, publishes load every `load_interval_s`, numbers and keeps published
chunks (`self.streams`), and on teardown drains `self.tasks` (`drain_timeout_s`, then cancels the rest)
before stopping the engine. Details: docs/worker.md, "Service lifecycle".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from libs.engine.async_engine import AsyncEngine, EngineDeadError
from libs.engine.core import EngineCore
from libs.engine.gcache_tier import l3_namespace
from libs.gcache.api import BlockStore
from libs.kvcache import block_hashes
from libs.mm.api import EncoderAPI
from libs.service import Service
from libs.transfer import KVTransferEngine, advertised_address, create_engine
from libs.worker import metrics
from libs.worker.config import DisaggServiceConfig, EngineServiceConfig
from libs.worker.engine import build_async_engine
from libs.worker.gcache import GCacheLink
from libs.worker.kv_events import KVFeed
from libs.worker.kv_wire import layout_labels
from libs.worker.metrics import Outcomes
from libs.worker.mm import EmbeddingFetcher, LazyEncoder
from libs.worker.stream_ledger import StreamLedger
from libs.worker.tasks import RequestTasks
from libs.worker.wire import load_from, request_refusal
from protos import subjects
from protos.messages import (
    AbortRequest,
    AckStatus,
    GenerateAck,
    GenerateRequest,
    KVSnapshotRequest,
    RegistryEntry,
    Role,
    ServiceState,
    StreamReplayReply,
    StreamReplayRequest,
    TokenChunk,
    WorkerLoad,
)

if TYPE_CHECKING:  # the SDK (and its IO stack) is imported only when GCache is on
    from libs.bus import RegistryView
    from libs.gcache.client import GCacheClient
    from libs.mm.client import EncoderClient

Refusal = tuple[AckStatus, str]
log = logging.getLogger("windserve.worker")

_LOAD_TIMEOUT_S = 10.0  # one load snapshot (waits for the current engine step)
_FLUSH_TIMEOUT_S = 5.0  # the engine running the commands queued by cancelled requests, at teardown


class EngineWorkerService(Service):
    """Base of every engine-hosting service (module docstring)."""

    config: EngineServiceConfig
    core_class: ClassVar[type[EngineCore]] = EngineCore

    def __init__(self, config: EngineServiceConfig) -> None:
        super().__init__(config)
        self.engine: AsyncEngine | None = None
        self.kv_feed: KVFeed | None = None
        self.tasks = RequestTasks(remember=config.recent_aborts)
        self.outcomes = Outcomes()
        self.streams = StreamLedger()
        self.load = WorkerLoad()
        self.address = config.data_address
        # GCache (L3): a test injects its BlockStore here before setup; else, with `gcache` on, setup builds the
        # real client (and closes it at teardown)
        self.gcache_store: BlockStore | None = None
        self.gcache: GCacheLink | None = None
        self._gcache_client: GCacheClient | None = None  # the real client this service started (it closes it)
        # multimodal models (#16): a test injects an EncoderAPI here before setup; else the real EncoderClient is
        # built on first use (closed at teardown). `fetcher` gets every request's embeddings before admission.
        self.encoder: EncoderAPI | None = None
        self.fetcher: EmbeddingFetcher | None = None
        self._encoder_client: EncoderClient | None = None
        self._encoder_view: RegistryView | None = None
        self._mm_transfer: KVTransferEngine | None = None

    # --- hooks for the roles ----------------------------------------------------------------------

    async def setup_role(self) -> None:
        """Build the role's handler object and serve the role's subject (engine and aborts are ready)."""

    def role_refusal(self, req: GenerateRequest) -> Refusal | None:
        """A role-specific reason to refuse a GenerateRequest (checked before the generic ones)."""
        return None

    def role_details(self) -> dict[str, str]:
        """Role-specific health details."""
        return {}

    def max_request_tokens(self) -> int:
        """Prompt + output tokens one request can ever hold here: the engine's bound (its full pool, or on one
        arena what the arena's units hold beside one window: `EngineCore.max_request_tokens`); before the engine
        is built, the static pools' (`EngineServiceConfig.max_request_tokens`)."""
        return self.engine.core.max_request_tokens if self.engine is not None else self.config.max_request_tokens

    def max_prompt_tokens(self) -> int:
        """Most prompt tokens one request may bring here beyond what `max_request_tokens` says (0 = no other
        limit); the registry entry advertises it so the gateway refuses what fits nowhere (413) up front."""
        return 0

    def role_outcomes(self) -> dict[str, int]:
        """Role-specific outcome counts (health details and `windserve_worker_requests_done`)."""
        return {}

    # --- lifecycle ----------------------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        return self.state in (ServiceState.STARTING, ServiceState.RUNNING)

    async def setup(self) -> None:
        assert self.bus is not None
        cfg = self.config
        engine = await asyncio.to_thread(build_async_engine, cfg.model or None, cfg.engine_config(),
                                         core_class=self.core_class, output_timeout_s=cfg.output_timeout_s,
                                         tiny_weights=cfg.tiny_weights or None)
        if cfg.gcache:
            await self.start_gcache(engine)
        if engine.core.model_config.vision is not None:
            await self.start_encoder_client(engine)
        engine.start()
        self.engine = engine
        aborts = await self.bus.subscribe(subjects.abort(cfg.namespace), AbortRequest)
        self.spawn(self._abort_loop(aborts), name="aborts", critical=True)
        await self.bus.serve(subjects.stream_replay(cfg.namespace, cfg.instance_id), StreamReplayRequest,
                             self._stream_replay)
        await self.start_kv_feed()
        await self.refresh_load()
        self.spawn(self._load_loop(), name="load", critical=True)
        if cfg.engine_stall_s > 0:
            self.spawn(self._engine_watch(engine, cfg.engine_stall_s), name="engine-watch")
        await self.setup_role()

    async def start_gcache(self, engine: AsyncEngine) -> None:
        """The GCache link over the injected store or the real client (engine built, not started yet)."""
        cfg, core = self.config, engine.core
        namespace = l3_namespace(cfg.model, core.model_config, core.cache.cfg, cfg.engine.dtype, core.draft_layers)
        store = self.gcache_store
        if store is None:
            # the real SDK (storage nodes over the registry); imported only when GCache is on
            from libs.gcache.client import GCacheClient

            # the deployment's registry; keys carry the model namespace
            client = GCacheClient(cfg.nats_url, cfg.namespace, cfg.gcache_config())
            await client.start()
            self._gcache_client = store = client
        self.gcache = GCacheLink(engine, store, namespace, lookup_timeout_s=cfg.gcache_lookup_timeout_s,
                                 write_queue=cfg.gcache_write_queue, write_queue_bytes=cfg.gcache_write_queue_mib << 20,
                                 writeback_every=cfg.gcache_writeback_every)
        self.gcache.attach()

    async def start_encoder_client(self, engine: AsyncEngine) -> None:
        """The embedding fetcher of a multimodal model: over the injected EncoderAPI (tests), else over the real
        EncoderClient, built on the first request with images (`_build_encoder_client`): a deployment that never
        sends one starts no registry view, client or extra transfer engine."""
        encoder = self.encoder if self.encoder is not None else LazyEncoder(self._build_encoder_client)
        self.fetcher = EmbeddingFetcher(encoder, engine.core.config.torch_dtype, self.config.mm_fetch_timeout_s)

    async def _build_encoder_client(self) -> EncoderAPI:
        """EncoderClient over the encoders in the registry and this worker's transfer engine (`mm_transfer`);
        whatever it started is closed again when it fails half way (the next request tries again)."""
        from libs.bus import RegistryView, ViewConfig
        from libs.mm.client import EncoderClient

        assert self.bus is not None and self.registry is not None
        cfg = self.config
        try:
            self._encoder_view = RegistryView(self.registry, role=Role.ENCODER,
                                              config=ViewConfig(list_timeout_s=cfg.connect_timeout_s))
            await self._encoder_view.start()
            client = EncoderClient(self.bus, cfg.namespace, self._encoder_view, engine=await self.mm_transfer())
            await client.start()
        except BaseException:
            await self.close_encoder_client()
            raise
        self._encoder_client = client
        return client

    async def mm_transfer(self) -> KVTransferEngine:
        """The transfer engine embeddings arrive on: the combined worker starts one of its own (closed at
        teardown); prefill and decode use their KV engine."""
        if self._mm_transfer is None:
            self._mm_transfer = create_engine()
            await self._mm_transfer.start(host=self.config.mm_transfer_host)
        return self._mm_transfer

    async def close_encoder_client(self) -> None:
        client, self._encoder_client = self._encoder_client, None
        view, self._encoder_view = self._encoder_view, None
        transfer, self._mm_transfer = self._mm_transfer, None
        with contextlib.suppress(Exception):
            if client is not None:
                await client.close()
        with contextlib.suppress(Exception):
            if view is not None:
                await view.stop()
        with contextlib.suppress(Exception):
            if transfer is not None and transfer is not getattr(self, "transfer", None):
                await transfer.close()

    async def start_kv_feed(self) -> None:
        """The KV-affinity feed (libs/worker/kv_events.py): the cache's events, snapshots, hit reports."""
        assert self.bus is not None and self.engine is not None
        cfg = self.config
        feed = self.kv_feed = KVFeed(self.engine, self.bus.publish, cfg.namespace, cfg.instance_id,
                                     events=cfg.kv_events, hits=cfg.kv_hit_reports,
                                     interval_s=cfg.kv_events_interval_s, max_batch_blocks=cfg.kv_events_max_blocks)
        if not feed.enabled:
            return
        feed.attach()
        self.spawn(feed.run(), name="kv_feed", critical=True)
        if feed.events_on:
            await self.bus.serve(subjects.kv_snapshot(cfg.namespace, cfg.instance_id), KVSnapshotRequest,
                                 feed.answer_snapshot)

    async def teardown(self) -> None:
        try:
            await self._stop_engine()
        finally:
            await self.close_gcache()  # also when setup failed between starting the client and the engine
            await self.close_encoder_client()

    async def _stop_engine(self) -> None:
        await self.tasks.drain(self.config.drain_timeout_s)
        if self.engine is None:
            return
        if self.engine.failed is not None and self.engine.thread_alive:
            log.error("engine step loop is stuck: not waiting for it (the process exits without it)")
            return
        # Cancelled requests queued their engine aborts / releases; commands run in order, so once this
        # no-op has run they have too, and the engine stops with its pools back at baseline.
        with contextlib.suppress(Exception):
            await self.engine.call(_noop, timeout_s=_FLUSH_TIMEOUT_S)
        if self.kv_feed is not None:
            self.kv_feed.detach()
        await asyncio.to_thread(self.engine.shutdown)
        await asyncio.to_thread(self.engine.core.close)  # (a parallel engine's rank processes stop here)

    async def close_gcache(self) -> None:
        """Stop the write-back, then close the client this service built (after the engine stopped)."""
        if self.gcache is not None:
            await asyncio.to_thread(self.gcache.close)
        if self._gcache_client is not None:
            client, self._gcache_client = self._gcache_client, None
            await client.close()

    async def _abort_loop(self, aborts) -> None:
        async for msg in aborts:
            self.tasks.cancel(msg.request_id)

    # --- requests -----------------------------------------------------------------------------------

    async def serve_generate(self, start: Callable[[GenerateRequest], object]) -> None:
        """Serve `windserve.<ns>.worker.<id>.generate`: answer a GenerateAck at once, and `start(req)`
        (which spawns the request's task into self.tasks) when the request is accepted."""
        assert self.bus is not None

        async def generate(req: GenerateRequest) -> GenerateAck:
            return self.accept(req, start)

        await self.bus.serve(subjects.generate(self.config.namespace, self.config.instance_id), GenerateRequest,
                             generate)

    def accept(self, req: GenerateRequest, start: Callable[[GenerateRequest], object]) -> GenerateAck:
        """The GenerateAck for `req`; starts it unless refused. Never blocks on the engine."""
        refusal = self.refusal(req)
        if refusal is not None:
            self.outcomes.refused += 1
            return GenerateAck(request_id=req.request_id, instance_id=self.config.instance_id,
                               status=refusal[0], message=refusal[1])
        start(req)
        self.outcomes.accepted += 1
        return GenerateAck(request_id=req.request_id, instance_id=self.config.instance_id)

    def refusal(self, req: GenerateRequest) -> Refusal | None:
        """Why this worker does not take `req` now (draining, duplicate id, role, size, tokens) or None."""
        if not self.accepting:
            return AckStatus.BUSY, f"{self.role.value} {self.config.instance_id} is draining"
        if req.request_id in self.tasks:
            return AckStatus.INVALID, f"request id {req.request_id!r} is already running"
        assert self.engine is not None
        mc = self.engine.core.model_config
        return self.role_refusal(req) or request_refusal(req, int(mc.vocab_size), self.max_request_tokens(),
                                                         mc.vision is not None)

    async def publish(self, subject: str, chunk: TokenChunk) -> None:
        """Publish a TokenChunk on a request's stream (the roles' injected `publish`)."""
        assert self.bus is not None
        self.outcomes.observe(chunk)
        await self.bus.publish(subject, self.streams.number(chunk))

    async def _stream_replay(self, req: StreamReplayRequest) -> StreamReplayReply:
        return self.streams.replay(req.request_id, req.from_seq)

    # --- load, registry, health, metrics --------------------------------------------------------------

    async def refresh_load(self) -> None:
        assert self.engine is not None
        load = await self.engine.call(lambda core: core.load(), timeout_s=_LOAD_TIMEOUT_S)
        self.load = load_from(load, time.time())
        metrics.export(load, self.outcome_counts(), self.gcache.counts() if self.gcache is not None else None)

    async def _load_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.load_interval_s)
            try:
                await self.refresh_load()
            except TimeoutError:  # a long step (or a stuck one: the engine watch judges that) delays the snapshot
                log.warning("load snapshot timed out: the engine is in a long step",
                            extra={"timeout_s": _LOAD_TIMEOUT_S})
                continue
            self.refresh_registration()

    async def _engine_watch(self, engine: AsyncEngine, bound_s: float) -> None:
        """Fail this worker when its step loop is stuck for `bound_s` (its round count has not moved) or has
        crashed: the in-flight requests get `EngineDeadError` at once (their error chunks say the instance
        failed, so the gateway retries those that streamed nothing elsewhere), then the service stops and the
        process exits with code 70 for its restart policy. Only time this watch observed counts (a late wake-up
        counts two periods at most): a process resumed after SIGSTOP is judged on what it does next."""
        period = min(1.0, bound_s / 4)
        seen, stuck, last = engine.rounds, 0.0, time.monotonic()
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            waited, last = min(now - last, 2 * period), now
            if engine.failed is not None:
                self.fail(f"engine step loop failed: {engine.failed!r}")
                return
            if engine.rounds != seen:
                seen, stuck = engine.rounds, 0.0
                continue
            stuck += waited
            if stuck >= bound_s:
                reason = f"engine step loop stuck in one round for {stuck:.0f} s (engine_stall_s {bound_s:g})"
                engine.fail(EngineDeadError(reason))
                self.fail(reason)
                return

    def outcome_counts(self) -> dict[str, int]:
        return {**self.outcomes.as_dict(), **self.role_outcomes()}

    def registry_entry(self) -> RegistryEntry:
        base = super().registry_entry()
        return base.model_copy(update={
            "address": self.address,
            "capacity": self.config.capacity or self.max_request_tokens(),
            "buckets": list(self.config.engine.scheduler.served_buckets or ()),
            "max_tokens": self.max_request_tokens(),
            "max_prompt_tokens": self.max_prompt_tokens(),
            "load": self.load,
            "labels": {**base.labels, **self.layout_labels()},
        })

    def layout_labels(self) -> dict[str, str]:
        """`KV_LAYOUT_LABELS` from the engine's cache config (none before the engine is built)."""
        return layout_labels(self.engine.core.cache.cfg) if self.engine is not None else {}

    def prompt_chain(self, token_ids: list[int]) -> list[int]:
        """The block-hash chain of `token_ids` as this worker's cache (and so the router's index) hashes it."""
        if self.engine is None:
            return []
        cfg = self.engine.core.cache.cfg
        return block_hashes(token_ids, cfg.page_size, cfg.hash_seed)

    def health_details(self) -> dict[str, str]:
        details = {"model": self.config.model or "tiny", "address": self.address,
                   "serving": "yes" if self.engine else "not yet"}
        details.update({k: str(v) for k, v in self.load.model_dump(exclude={"schema_version"}).items()})
        details.update({k: str(v) for k, v in self.outcome_counts().items()})
        details["in_flight_requests"] = str(len(self.tasks))
        if self.engine is not None:  # the parallel layout, and the device KV bytes each rank holds (#18)
            details["parallel"] = self.engine.core.config.layout.describe()
            details["kv_bytes_per_rank"] = str(sum(self.engine.core.runner.kv.pool_bytes().values()))
            details["compile"] = str(self.engine.core.compile_stats)
        if self.kv_feed is not None and self.kv_feed.enabled:
            details.update(self.kv_feed.stats.as_details())
        if self.gcache is not None:
            details.update({f"gcache_{k}": str(v) for k, v in self.gcache.counts().items()})
        if self.fetcher is not None:
            details.update({k: str(v) for k, v in self.fetcher.counts().items()})
        details.update(self.role_details())
        return details


class DisaggWorkerService(EngineWorkerService):
    """An engine worker with a KV transfer engine (prefill, decode): started before the engine, closed after."""

    config: DisaggServiceConfig

    def __init__(self, config: DisaggServiceConfig) -> None:
        super().__init__(config)
        # UCX or the TCP fallback (a bad WINDSERVE_TRANSFER fails here, before any IO); started in setup()
        self.transfer: KVTransferEngine = create_engine()

    async def setup(self) -> None:
        self.address = advertised_address(await self.transfer.start(host=self.config.transfer_host),
                                          self.config.advertise_host)
        await super().setup()

    async def mm_transfer(self) -> KVTransferEngine:
        return self.transfer  # embeddings arrive on the KV engine (own transfer ids)

    async def teardown(self) -> None:
        try:
            await super().teardown()
        finally:
            await self.transfer.close()


def _noop(core: EngineCore) -> None:
    return None
