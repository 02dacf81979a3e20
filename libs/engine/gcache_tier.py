"""The torch side of GCache (L3): the byte layout of L3 values, copying a finishing sequence's KV out (the
write-back's engine-thread half) and writing fetched values into host-tier pages (the import's).

Per page-aligned block b (keys: libs.gcache.keys under `l3_namespace`) L3 holds a full value `F:<hash>` (the
block's full-attention page of every layer, K then V, in the pool dtype) and, where `L3Export` writes one,
an SWA checkpoint `S:<hash>` (the SWA pages of the window ending at b); sizes in `ValueLayout`. The pure
bookkeeping (which hit to take, bytes per token) is libs/kvcache/gcache_tier.py. Details: docs/kvcache.md,
"Engine integration (L3)".
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from libs.gcache.api import Buffer
from libs.gcache.keys import full_key, model_namespace, swa_key
from libs.kvcache import KVCacheConfig, KVLayout, l3_checkpoints
from libs.model.paged import KVPools

if TYPE_CHECKING:
    from libs.engine.scheduler import Seq

log = logging.getLogger(__name__)

__all__ = ["Buffer", "KnownBlocks", "L3Export", "StagedValues", "ValueLayout", "WriteBack",
           "kv_layout", "l3_namespace", "stage_values", "write_host_blocks"]


@dataclass(frozen=True)
class ValueLayout:
    """Byte sizes of L3 values for one engine's pools."""

    page_size: int
    window_pages: int
    full_bytes: int  # one block's full value
    swa_page_bytes: int  # one page of a checkpoint

    @classmethod
    def of(cls, kv: KVPools, window_pages: int) -> ValueLayout:
        return cls(kv.page_size, window_pages, kv.page_bytes("full"), kv.page_bytes("swa"))

    def swa_bytes(self, end: int) -> int:
        """Bytes of the checkpoint ending at page `end` (exclusive): min(window pages, end) SWA pages."""
        return min(self.window_pages, end) * self.swa_page_bytes


def kv_layout(model_config, dtype: torch.dtype, draft_layers: int = 0) -> KVLayout:
    """The model's KV byte layout (libs.kvcache.KVLayout) in the pool dtype: what `l3_footprint` and pool sizing
    (`plan_pools`) need. `draft_layers`: MTP blocks the engine drafts with (speculative_tokens); their KV is
    extra SWA-pool layers, so an SWA page is that much larger."""
    es = torch.empty((), dtype=dtype).element_size()
    per_head = (model_config.qk_head_dim + model_config.v_head_dim) * es
    return KVLayout(len(model_config.full_layers), len(model_config.swa_layers) + draft_layers,
                    model_config.kv_heads_full * per_head, model_config.kv_heads_swa * per_head)


def l3_namespace(model: str, model_config, cache: KVCacheConfig, dtype: str, draft_layers: int = 0) -> str:
    """The GCache namespace of one model's KV: name, layout (layer kinds, KV heads, head dims, window, sinks),
    page size, dtype and hash seed, so two models (or two layouts of one) never read each other's bytes."""
    mc = model_config
    layout = (f"layers={''.join('S' if s else 'F' for s in mc.layer_is_swa)};kv={mc.kv_heads_full},{mc.kv_heads_swa};"
              f"head={mc.qk_head_dim},{mc.v_head_dim};window={mc.sliding_window};"
              f"sinks={int(mc.swa_sinks)},{int(mc.full_sinks)}")
    if draft_layers:  # the SWA values then carry the MTP blocks' KV too: other bytes, another namespace
        layout += f";mtp={draft_layers}"
    return model_namespace(model or "tiny", layout, cache.page_size, dtype, cache.hash_seed)


# ---------------------------------------------------------------------------------------------- bytes

def _page_bytes(t: torch.Tensor) -> int:
    """Bytes of one page of a pool tensor [layers, pages, page, heads, dim] across its layers (from the shape
    alone: an arena engine's per-group tensors hold no pages, only the shapes)."""
    return t.shape[0] * math.prod(t.shape[2:]) * t.element_size()


def _records(k: torch.Tensor, v: torch.Tensor) -> list[list[memoryview]]:
    """Per page, the (K, V) byte views of a `KVPools.gather_pages` result copied to host memory."""
    rows = [t.cpu().contiguous().view(len(t), -1).view(torch.uint8).numpy() for t in (k, v)]
    return [[rows[0][j].data, rows[1][j].data] for j in range(len(k))]


def _unpack(k: torch.Tensor, v: torch.Tensor, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of the write-back's records: `data` [pages, bytes per page: K then V] as K and V [layers,
    pages, page, heads, dim],
    contiguous, in the pools' dtype (on the CPU)."""
    out = []
    off = 0
    for t in (k, v):
        n = _page_bytes(t)
        part = data[:, off:off + n].contiguous().view(t.dtype).view(len(data), t.shape[0], *t.shape[2:])
        out.append(part.transpose(0, 1).contiguous())
        off += n
    return out[0], out[1]


@dataclass(frozen=True)
class StagedValues:
    """Fetched L3 values as host-pool-shaped tensors (`stage_values`, off the engine thread): full K / V
    [full layers, blocks, ...] and the checkpoint's SWA K / V [SWA layers, window pages, ...]."""

    full_k: torch.Tensor
    full_v: torch.Tensor
    swa_k: torch.Tensor
    swa_v: torch.Tensor

    @property
    def blocks(self) -> int:
        return self.full_k.shape[1]

    @property
    def swa_pages(self) -> int:
        return self.swa_k.shape[1]


def stage_values(host: KVPools, layout: ValueLayout, full_values: Sequence[Buffer], swa_value: Buffer,
                 end: int) -> StagedValues:
    """Check the fetched values' sizes against this engine's layout (the checkpoint ends at page `end`) and lay
    them out like the host pools, so the engine thread only runs one indexed copy per pool tensor. ValueError
    on a size mismatch (another layout under the same namespace would be a bug: a miss, never wrong bytes)."""
    if any(memoryview(v).nbytes != layout.full_bytes for v in full_values) or (
            memoryview(swa_value).nbytes != layout.swa_bytes(end)):
        raise ValueError(f"GCache values do not have this engine's layout sizes ({layout})")
    # bytearray().join: one copy of the fetched values, writable (torch.frombuffer)
    full = torch.frombuffer(bytearray().join(full_values), dtype=torch.uint8).view(len(full_values), -1)
    swa = torch.frombuffer(bytearray(swa_value), dtype=torch.uint8).view(min(layout.window_pages, end), -1)
    return StagedValues(*_unpack(host.full_k, host.full_v, full), *_unpack(host.swa_k, host.swa_v, swa))


def write_host_blocks(host: KVPools | None, full_ids: Sequence[int], swa_ids: Sequence[int], staged: StagedValues,
                      skip: int = 0, units: dict[str, torch.Tensor | None] | None = None) -> None:
    """Write staged L3 values into host-tier pages: staged block `skip + j` into full page `full_ids[j]`, the
    checkpoint's pages into `swa_ids`. One indexed copy per pool tensor, on the calling (engine) thread, over the
    pools' flat rows (`KVPools.flat_rows`: two host pools, or one host arena whose pages the cache just handed
    out, so their units are the table's; `units` per group: those units given, for an arena without tables, a
    parallel engine's other ranks)."""
    if host is None:
        raise RuntimeError("a GCache import needs the engine's host tier")
    for group, k, v, pages in (("full", staged.full_k[:, skip:], staged.full_v[:, skip:], full_ids),
                               ("swa", staged.swa_k, staged.swa_v, swa_ids)):
        if not len(pages):
            continue
        rows = host.flat_rows(group, torch.tensor(list(pages), dtype=torch.int64),
                              (units or {}).get(group)).flatten()  # layer-major
        for dst, src in zip(host.flat_kv(group), (k, v), strict=True):
            dst.index_copy_(0, rows, src.reshape(-1, dst.shape[1]).to(dst.dtype))


# ---------------------------------------------------------------------------------------------- write-back

class KnownBlocks:
    """A bounded LRU set of L3 values this worker wrote or imported (block hash, full or checkpoint): the
    write-back skips them. Engine thread only."""

    _SWA = 1 << 64  # checkpoint entries: the hash shifted out of the 64-bit range of full entries

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._lru: OrderedDict[int, None] = OrderedDict()

    def has_full(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def has_swa(self, block_hash: int) -> bool:
        return block_hash | self._SWA in self._lru

    def add(self, full_hashes: Sequence[int], swa_hashes: Sequence[int] = ()) -> None:
        lru = self._lru
        for h in (*full_hashes, *(h | self._SWA for h in swa_hashes)):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.max_entries:
            lru.popitem(last=False)

    def __len__(self) -> int:
        return len(self._lru)


@dataclass
class WriteBack:
    """One finished sequence's values on their way to the store: `full` (K, V page-major,
    `KVPools.gather_pages`) row j is the value of `full_keys[j]`; `swa` (K, V page-major, or None) holds the
    checkpoints' pages back to back, the first `swa_pages[0]` rows the checkpoint under `swa_keys[0]`, and so
    on. The tensors are copies (on the pools' device); `ready` (CUDA) is recorded after the copies, so another
    thread waits on it."""

    full_keys: list[str]
    full: tuple[torch.Tensor, torch.Tensor] | None
    swa_keys: list[str]
    swa_pages: list[int]
    swa: tuple[torch.Tensor, torch.Tensor] | None
    ready: torch.cuda.Event | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in (self.full, self.swa) if kv is not None for t in kv)

    def items(self) -> list[tuple[str, Buffer]]:
        """(key, value) pairs for `BlockStore.put_nowait`: host copies joined into one byte string per value
        (call off the engine thread)."""
        if self.ready is not None:
            self.ready.synchronize()
        out: list[tuple[str, Buffer]] = []
        if self.full is not None:
            out += [(k, b"".join(rec)) for k, rec in zip(self.full_keys, _records(*self.full), strict=True)]
        if self.swa is not None:
            recs, at = _records(*self.swa), 0
            for key, n in zip(self.swa_keys, self.swa_pages, strict=True):
                out.append((key, b"".join(b for rec in recs[at:at + n] for b in rec)))
                at += n
        return out


class L3Export:
    """The scheduler's `on_finish` hook: copies a finishing sequence's new L3 values out of the device pools and
    hands them to `sink` (the worker's bounded write-back queue; False = full, the batch is dropped).

    It writes the full value of every page-aligned computed block not in `known`, and the SWA checkpoints
    `libs.kvcache.l3_checkpoints` names that are not in `known`: always the one at the last full block and,
    with `checkpoint_every_pages`, the periodic ones whose window the cache still kept (best effort). On the
    engine thread it costs a lookup per block and one gather per pool tensor of the new pages.
    """

    def __init__(self, kv: KVPools, cache, namespace: str, known: KnownBlocks,
                 sink: Callable[[WriteBack], bool],
                 gather: Callable[[str, Sequence[int]], tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        self.kv = kv
        # (group, pages) -> the pages' K and V page-major, every KV head (a parallel runner gathers its ranks')
        self.gather = gather or (lambda group, pages: kv.gather_pages(group, list(pages)))
        self.cache = cache
        self.namespace = namespace
        self.known = known
        self.sink = sink
        self.queued = 0  # write-back batches handed to the sink
        self.dropped = 0  # batches the sink refused (queue full)
        self.failed = 0  # finishes whose copy-out raised (logged; the finish goes on)

    def __call__(self, seq: Seq) -> None:
        try:
            self._export(seq)
        except Exception:  # the write-back is best effort: a finish must never fail for it
            self.failed += 1
            log.exception("GCache write-back of %s failed", seq.req_id)

    def _export(self, seq: Seq) -> None:
        cfg = self.cache.cfg
        P, wp = cfg.page_size, cfg.window_pages
        npg = seq.num_computed // P
        if npg == 0:
            return
        hashes = seq.block_hashes(P, cfg.hash_seed)
        full, swa = self.cache.page_tables(seq.req_id)
        known = self.known
        new = [j for j in range(npg) if full[j] >= 0 and not known.has_full(hashes[j])]
        ends = [e for e in l3_checkpoints(swa, npg, wp, cfg.checkpoint_every_pages)
                if not known.has_swa(hashes[e - 1])]
        if not new and not ends:
            return
        kv, ns = self.kv, self.namespace
        windows = [swa[max(0, e - wp):e] for e in ends]
        job = WriteBack([full_key(ns, hashes[j]) for j in new],
                        self.gather("full", [full[j] for j in new]) if new else None,
                        [swa_key(ns, hashes[e - 1]) for e in ends], [len(w) for w in windows],
                        self.gather("swa", [p for w in windows for p in w]) if ends else None)
        if kv.device.type == "cuda":
            job.ready = torch.cuda.Event()
            job.ready.record()
        if not self.sink(job):
            self.dropped += 1
            return
        self.queued += 1
        known.add([hashes[j] for j in new], [hashes[e - 1] for e in ends])
