"""An engine worker's link to GCache (L3): the lookup that prefetches an L3 hit into the host tier before a
request enters the engine, and the write-back of sequences (docs/kvcache.md, "Engine integration (L3)").

    request ──> prefetch (service loop, bounded) ──> engine thread: import into L2, then add_request
                  local pages (engine peek) ‖ exists(F, S keys)    match / valid-hit rule / layer-wise load-back
                  -> longest valid L3 hit -> get(values)
    finish, and every `writeback_every` tokens of a running sequence (engine thread)
                  ──> L3Export copies the new values out ──> bounded queue (full: dropped, counted)
                  ──> writer thread: host bytes ──> BlockStore.put_nowait

Every role (combined worker, prefill, decode) gets it from the engine-worker base (libs/worker/service.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from dataclasses import dataclass

from libs.engine.async_engine import AsyncEngine, Prefetched
from libs.engine.core import EngineCore
from libs.engine.gcache_tier import KnownBlocks, L3Export, StagedValues, ValueLayout, WriteBack, stage_values
from libs.engine.request import Request
from libs.gcache.api import BlockStore
from libs.gcache.keys import full_key, swa_key
from libs.kvcache import block_hashes, l3_hit_end

log = logging.getLogger("windserve.gcache")

_CLOSE_TIMEOUT_S = 5.0  # the writer thread finishing the batch in hand at close


@dataclass
class GCacheLinkStats:
    """L3 counts since start (health details, `windserve_worker_gcache{event}`)."""

    lookups: int = 0  # prompts looked up (longer than one page)
    hits: int = 0  # lookups that imported an L3 hit into the host tier
    misses: int = 0  # no valid L3 hit beyond the local cache, or a value missing at get
    refused: int = 0  # hits fetched that the engine did not import (its tree changed meanwhile, no host room)
    timeouts: int = 0  # lookups slower than their bound (a miss)
    errors: int = 0  # lookups that failed otherwise (a miss)
    imported_tokens: int = 0  # tokens of imported hits
    writebacks: int = 0  # finished sequences' batches handed to the store
    written_values: int = 0  # values in them
    dropped: int = 0  # batches dropped: the write-back queue was full (here or in the store's client)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class _Hit:
    tokens: list[int]
    hashes: list[int]
    first: int
    end: int
    values: StagedValues


class GCacheLink:
    """Lookup + prefetch and write-back between one AsyncEngine and a BlockStore under `namespace`.

    `attach()` (before the engine starts, or on its thread) installs the engine's prefetch hook and the
    scheduler's finish hook and starts the writer thread; `close()` stops it. `write_queue` batches and
    `write_queue_bytes` bytes wait at most between the engine and the store; beyond, a batch is dropped."""

    def __init__(self, engine: AsyncEngine, store: BlockStore, namespace: str, *, lookup_timeout_s: float = 0.5,
                 write_queue: int = 64, write_queue_bytes: int = 256 << 20, known_blocks: int = 1 << 16,
                 writeback_every: int = 0) -> None:
        self.engine = engine
        self.store = store
        self.namespace = namespace
        self.lookup_timeout_s = lookup_timeout_s
        self.write_queue_bytes = write_queue_bytes
        self.writeback_every = writeback_every
        self.stats = GCacheLinkStats()
        core = engine.core
        self.layout: ValueLayout = core.l3_layout()
        self.known = KnownBlocks(known_blocks)
        self._queue: queue.Queue[WriteBack | None] = queue.Queue(maxsize=write_queue)
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._export = L3Export(core.runner.kv, core.cache, namespace, self.known, self._offer, core.runner.l3_gather)
        self._writer: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def attach(self) -> None:
        if self.engine.core.cache.host is None:
            raise ValueError("GCache needs a host tier on the engine (num_host_full_pages / num_host_swa_pages)")
        self.engine.set_prefetch(self.prefetch)
        scheduler = self.engine.core.scheduler
        scheduler.on_finish = self._export
        if self.writeback_every > 0:  # running sequences too, every so many tokens (their new pages only)
            scheduler.on_progress, scheduler.progress_every = self._export, self.writeback_every
        self._writer = threading.Thread(target=self._write_loop, name="gcache-writeback", daemon=True)
        self._writer.start()

    def close(self) -> None:
        """Stop the writer (batches still queued are dropped: the store is closing too)."""
        self.engine.set_prefetch(None)
        if self._writer is None:
            return
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)
        self._writer.join(_CLOSE_TIMEOUT_S)
        self._writer = None

    def counts(self) -> dict[str, int]:
        """The stats with the engine-thread counters folded in (drops on either side of the queue)."""
        out = self.stats.as_dict()
        out["dropped"] += self._export.dropped
        out["writeback_failures"] = self._export.failed
        return out

    # ------------------------------------------------------------------ lookup + prefetch
    async def prefetch(self, req: Request) -> Prefetched:
        """The AsyncEngine prefetch hook: the longest valid L3 hit beyond the local cache, fetched within
        `lookup_timeout_s`, as the engine-thread import to run before the request is added (None: a miss)."""
        tokens = req.start_token_ids  # (a migrated stream's: the prompt and the tokens it already sent)
        max_pages = (len(tokens) - 1) // self.layout.page_size  # a hit stays below the prompt's last token
        if max_pages <= 0:
            return None
        self.stats.lookups += 1
        try:
            async with asyncio.timeout(self.lookup_timeout_s):
                hit = await self._lookup(req, tokens, max_pages)
        except TimeoutError:
            self.stats.timeouts += 1
            return None
        except Exception:
            self.stats.errors += 1
            log.warning("GCache lookup of %s failed; a miss", req.req_id, exc_info=True)
            return None
        if hit is None:
            self.stats.misses += 1
            return None
        return lambda core: self._import(core, hit)

    async def _lookup(self, req: Request, tokens: list[int], max_pages: int) -> _Hit | None:
        cfg = self.engine.core.cache.cfg
        hashes = block_hashes(tokens[:max_pages * cfg.page_size], cfg.page_size, cfg.hash_seed)
        ns = self.namespace
        fkeys = [full_key(ns, h) for h in hashes]
        skeys = [swa_key(ns, h) for h in hashes]
        # what the local tree (device + host) holds, asked on the engine thread while the store answers
        local, present = await asyncio.gather(
            self.engine.call(lambda core: core.cache.cached_pages(tokens, hashes),
                             urgent=self.engine.core.is_urgent(req)),
            self.store.exists(fkeys + skeys))
        end = l3_hit_end(local, present[:max_pages], present[max_pages:], cfg.window_pages, max_pages)
        if end == 0:
            return None
        values = await self.store.get([*fkeys[local:end], skeys[end - 1]])
        if any(v is None for v in values):
            return None  # a value left (or failed its checksum) since exists: a miss, never a partial hit
        shapes = self.engine.core.runner.kv_access().shapes  # (the values' shapes: every KV head)
        staged = await asyncio.to_thread(stage_values, shapes, self.layout, values[:-1], values[-1], end)  # type: ignore[arg-type]
        return _Hit(tokens, hashes, local, end, staged)

    def _import(self, core: EngineCore, hit: _Hit) -> None:
        """Engine thread, right before add_request."""
        pages = core.import_l3(hit.tokens, hit.hashes, hit.first, hit.end, hit.values)
        if not pages:
            self.stats.refused += 1  # (counted on the engine thread; the loop counts the other misses)
            return
        self.stats.hits += 1
        self.stats.imported_tokens += pages * self.layout.page_size
        self.known.add(hit.hashes[hit.end - pages:hit.end], [hit.hashes[hit.end - 1]])

    # ------------------------------------------------------------------ write-back
    def _offer(self, job: WriteBack) -> bool:
        """L3Export's sink (engine thread): queue the batch unless the queue is full (never blocks)."""
        with self._lock:
            if self._pending_bytes + job.nbytes > self.write_queue_bytes:
                return False
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                return False
            self._pending_bytes += job.nbytes
        return True

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                items = job.items()
                if self.store.put_nowait(items):
                    self.stats.writebacks += 1
                    self.stats.written_values += len(items)
                else:
                    self.stats.dropped += 1
            except Exception:
                self.stats.dropped += 1
                log.warning("GCache write-back failed; dropped", exc_info=True)
            finally:
                with self._lock:
                    self._pending_bytes -= job.nbytes
